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

**Compressed requests are never retracted** (issue 25, item 4). SGLang over-admits on purpose: it counts a running
request's future tokens times ``new_token_ratio`` (0.7 at start, decaying to 0.098 over 600 steps while nothing is
retracted; ``NewTokenRatioTracker``), and retracts the requests with the fewest output tokens when a decode step
finds the pool short (``ScheduleBatch.retract_decode``). A compressed request retracted after its first
compression cannot resume (its dense KV is gone; re-prefilling would change its distribution), so the plugin
refused it and the engine redrew it: a step biased towards short responses, and wasted decode work. Now:

- a running compressible request counts its exact remaining need, at ratio 1 (``running_reserve``): its bound less
  the slots it holds past its prompt (evicted slots are freed, so what compression gives back is room again), at
  most the tokens it may still decode;
- retraction takes dense requests first, then compressible ones not yet compressed (a re-prefill rebuilds their
  dense KV exactly), compressed ones last (``retraction_rank``); each class in SGLang's own order;
- SGLang's forced retraction (``SGLANG_TEST_RETRACT``, a test switch) skips a batch whose requests are all
  compressed while the next step fits.

Why that is enough: with every compressible request counted at its exact need, the pool's free and evictable
slots cover the needs of all of them whenever a request is admitted, and stay covering them (a decode step takes
one slot off both sides, a compression gives W back to both, a finished or retracted request only adds room); so
a step that finds the pool short is short because of dense requests (counted at SGLang's ratio), and retracting
those is enough. Dense requests keep SGLang's behaviour (estimate, over-admission, retraction, re-prefill). A
retracted compressed request is still refused (``hooks._release_req``) if it ever happens: priority preemption
(``--enable-priority-scheduling``) can take one off the batch (``tests/sglang/test_plugin_preemption.py``);
``rollout/redraws`` would show it.
"""
from __future__ import annotations

import contextlib

from sglang_ext.accounting import owned_slots
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


def _bound_row(backend, req):
    """The row facts of a running compressible request (None for dense requests and unbound rows)."""
    row = req.kv.req_pool_idx
    info = backend.state.info[row] if row is not None else None
    if info is None or info.req is not req or info.config.is_dense:
        return None
    return info


def running_reserve(backend, req) -> int | None:
    """Future slots a running compressible request may still take from the pool, exactly, at ratio 1: its bound
    (B + W + 1) less the slots it owns past its prompt now, and no more than the tokens it may still decode (except
    a scope ``all`` request sharing its prompt with the radix tree before its first compression, whose first
    compression may copy up to B kept prompt tokens into new slots, ``accounting.extras_needed``). None: SGLang's
    own estimate (dense requests, rows whose overrides were refused, servers that free nothing)."""
    info = _bound_row(backend, req) if backend.compresses else None
    if info is None:
        return None
    row = req.kv.req_pool_idx
    room = max(request_bound(backend, req) - owned_slots(backend, row, req.kv, beyond_prompt=True), 0)
    if info.config.scope == "all" and backend.radix_enabled and not backend.state.compressed[row]:
        return room
    return min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), room)


KEEP_COMPRESSED, KEEP_COMPRESSIBLE, KEEP_DENSE = 0, 1, 2
"""Retraction ranks, kept first: compressed requests (cannot resume), compressible ones not yet compressed (resume
exactly), dense ones (SGLang's own)."""


def retraction_rank(backend, req) -> int:
    if not backend.compresses or _bound_row(backend, req) is None:
        return KEEP_DENSE
    return KEEP_COMPRESSED if backend.state.events[req.kv.req_pool_idx] > 0 else KEEP_COMPRESSIBLE
