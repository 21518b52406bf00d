"""KV-cache compression for Sparse-RL rollouts: engine-agnostic, pure torch.

The same functions run inside the HF reference engine (``rollout/hf_engine.py``) and, later, the SGLang
attention backend (``sglang_ext/``), so both engines keep exactly the same tokens for the same sequence.
The pieces are kept apart:

- ``config.CompressionConfig``: method (scorer name or ``none``), budget B, window alpha, buffer W,
  scope, scorer knobs; validated on construction.
- ``scorers``: ``rkv``, ``snapkv``, ``streamingllm``, ``h2o``, ``triattention`` (+ ``none``), chosen by name through
  ``SCORERS``; each maps :class:`ScoreInputs` to a score per KV head for every candidate before the window.
- ``selector.select_kept``: per KV head, top ``B - alpha`` by score (ties -> newer token) plus the alpha
  newest, ascending order; ``gather_kept`` applies it to any per-head tensor.
- ``schedule.CompressionSchedule``: when to compress and which tokens are candidates (budget scope).
- ``digest.KeptDigest``: a hash of the kept logical positions, to compare engines.

What an engine must pass for one compression of one layer of one sequence (``ScoreInputs``):

- ``keys`` / ``values``: [n, Hkv, N, D] the N candidates of this layer, in the order the cache holds
  them (oldest first; each head may hold different tokens after earlier compressions). Keys are
  **post-RoPE**, as both HF's cache and SGLang's KV pool store them. Scope ``all``: every cached token of
  the sequence; scope ``response``: the cached response tokens only (the prompt sits in front, untouched).
- ``queries``: [n, Hq, alpha, D] the **post-RoPE queries of the alpha most recent tokens** of the sequence
  (the tokens whose keys are the last alpha candidates), oldest first; after prefill these are the last
  alpha prompt tokens' queries. Needed by ``rkv`` and ``snapkv``.
- ``accumulated_attention``: [n, Hkv, N] (``h2o`` only) the sum over every query so far (prefill included)
  of ``attention.attention_mass``, gathered along with the keys at each compression.
- ``scaling``: the model's attention scale (default ``head_dim ** -0.5``).
- ``query_center`` [n, Hq, D], ``query_abs_center`` [n, Hq, D/2], ``query_position`` [n], ``rope_inv_freq``
  [D/2] (``triattention`` only): the pre-RoPE query centers of each layer and query head (``center_sums`` of
  the row's queries so far, or fixed calibrated ones), the position of the next token, the rotary frequencies.

When (``schedule``): after the forward pass that wrote and attended the newest token, before the next token
is appended: compress once the candidate count reaches B + W (decode), or more than B after prefill when
``compress_prefill``. The result keeps B candidates per layer and KV head; logical positions (RoPE) never
change, only the physical cache shrinks.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "attention_mass": "attention", "window_importance": "attention", "choose_kept": "compress",
    "DENSE_METHOD": "config", "CompressionConfig": "config", "KeptDigest": "digest", "key_redundancy": "redundancy",
    "CompressionSchedule": "schedule", "SCORERS": "scorers", "ScoreInputs": "scorers", "Scorer": "scorers",
    "get_scorer": "scorers", "gather_kept": "selector", "select_kept": "selector", "center_sums": "triattention",
    "triattention_logits": "triattention", "triattention_scores": "triattention", "unrotate": "triattention",
}
"""Where each exported name lives: loaded on first use, so that reading the registry of methods (a CLI's help)
does not import torch."""


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = [
    "DENSE_METHOD",
    "SCORERS",
    "CompressionConfig",
    "CompressionSchedule",
    "KeptDigest",
    "ScoreInputs",
    "Scorer",
    "attention_mass",
    "center_sums",
    "choose_kept",
    "gather_kept",
    "get_scorer",
    "key_redundancy",
    "select_kept",
    "triattention_logits",
    "triattention_scores",
    "unrotate",
    "window_importance",
]
