"""Admission by each request's own bound: how many future tokens SGLang's scheduler reserves for a request.

SGLang admits a waiting request when its prompt plus ``min(max_new_tokens, CLIP_MAX_NEW_TOKENS)`` future tokens
fit the pool's room (``PrefillAdder.add_one_req``; the last chunk of a chunked prefill in ``add_chunked_req``), and
counts ``min(remaining, CLIP_MAX_NEW_TOKENS)`` future tokens of every running request against that room
(``PrefillAdder._get_running_request_total_token_offset``, also in ``preempt_to_schedule``). A request whose
evicted slots are freed never holds more than its own B + W candidates past the prompt, plus the slot of the token
being decoded, so its bound is ``B + W + 1`` of *its* compression (the server's, or its ``custom_params``
override: the adaptive budget's per-step budget): a request at a smaller budget reserves less, and more of them
run at once. A dense request (per-request method ``none``) keeps SGLang's own clip (it grows to
``max_new_tokens``), as does one whose overrides are invalid (binding its row aborts it).

``CLIP_MAX_NEW_TOKENS`` is a module constant SGLang reads when those methods run; the hooks (``hooks.py``) set it to
the request's bound for the duration of the call and restore it (the scheduler is one thread; the calls for a
running request nested inside a waiting request's restore the outer value).
"""
from __future__ import annotations

import contextlib

from sglang_ext.config import REQUEST_KEY, ConfigError, request_compression

BOUND_ATTR = "_sparse_kv_admission_bound"
"""Where a request keeps its bound once computed (its overrides do not change while it waits or runs)."""


def sglang_clip() -> int:
    """SGLang's own clip of the future tokens it reserves per request (``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``,
    default 4096), read outside any ``clipped`` block (the backend reads it once, when it is built)."""
    from sglang.srt.managers import schedule_policy

    return int(schedule_policy.CLIP_MAX_NEW_TOKENS)


def request_bound(backend, req) -> int:
    """Future tokens admission reserves for ``req`` at most: its compression's B + W + 1 (see the module
    docstring), SGLang's clip for a dense request or when the server frees nothing (``free_evicted`` off)."""
    bound = getattr(req, BOUND_ATTR, None)
    if bound is not None:
        return bound
    bound = backend.sglang_clip
    if backend.compresses:
        overrides = (getattr(req.sampling_params, "custom_params", None) or {}).get(REQUEST_KEY)
        try:
            config = request_compression(backend.config.compression, overrides)
        except ConfigError:
            config = None   # refused when its row is bound
        if config is not None and not config.is_dense:
            bound = min(bound, config.max_candidates + 1)
    setattr(req, BOUND_ATTR, bound)
    return bound


@contextlib.contextmanager
def clipped(backend, req):
    """SGLang's ``CLIP_MAX_NEW_TOKENS`` is ``req``'s bound inside the block."""
    from sglang.srt.managers import schedule_policy

    saved = schedule_policy.CLIP_MAX_NEW_TOKENS
    schedule_policy.CLIP_MAX_NEW_TOKENS = request_bound(backend, req)
    try:
        yield
    finally:
        schedule_policy.CLIP_MAX_NEW_TOKENS = saved
