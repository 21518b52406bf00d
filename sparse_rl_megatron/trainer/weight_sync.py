"""Weight sync learner -> rollout engines, then a probe that every engine really serves the new weights.

Sync: every rank iterates the learner's HF-named buckets (``Learner.export_weights``, a collective that gives
every rank every bucket); each rank that drives an engine hands the stream of buckets to it (one
``update_weights(buckets, version)`` call), which moves each its own way (tensors in process, per-TP-rank CUDA-IPC
handles from the learner ranks on its GPUs, a broadcast to separate engine GPUs, or files it reloads):
``EnginePool.sync``. Probe: the learner's dense log-probs of a fixed sequence (drawn once from the run's seed)
against each engine's dense log-probs of the same sequence (compression off), and each engine's weight version;
a difference past the tolerance is an error naming the engine and its rank, since training on samples from stale
or garbled weights would be silently off-policy (``EnginePool.probe``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sparse_rl_megatron.learner.batch import SequenceBatch

PROBE_TOLERANCE_FP32 = 1e-3
"""Default probe tolerance with a float32 engine: the learner and an HF model in fp32 agree to ~1e-5 on CPU."""
PROBE_TOLERANCE_16BIT = 0.1
"""Default with a bf16/fp16 engine: two bf16 implementations of the same weights differ by a few 1e-2 in log-prob."""


class WeightSyncError(RuntimeError):
    """The engine does not serve the learner's weights after a sync."""


def probe_sequence(vocab_size: int, tokens: int, seed: int) -> "SequenceBatch":
    """One row of ``tokens`` token ids drawn from ``seed`` (first half prompt, second half response)."""
    from sparse_rl_megatron.learner.batch import SequenceBatch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab_size, (tokens,), generator=gen)
    half = tokens // 2
    return SequenceBatch([ids[:half]], [ids[half:]])


def default_tolerance(engine_dtype: str) -> float:
    return PROBE_TOLERANCE_FP32 if engine_dtype == "float32" else PROBE_TOLERANCE_16BIT


def sync_weights(learner, engine, version: int, bucket_mb: int) -> dict[str, float]:
    """Push the learner's weights to one engine on rank 0 (``engine``; None elsewhere) as ``version``. Collective.
    (A run's engines: ``EnginePool.sync``.)"""
    from sparse_rl_megatron.trainer.engine_pool import EnginePool

    pool = EnginePool.single(engine, None, "engine")
    try:
        return pool.sync(learner, version, bucket_mb)
    finally:
        pool.close()


def probe_weights(learner, engine, spec, probe: "SequenceBatch", tolerance: float, engine_name: str,
                  version: int) -> dict[str, float]:
    """Compare the dense log-probs of one engine on rank 0 (``engine``; None elsewhere) with the learner's.
    Collective; raises ``WeightSyncError`` on every rank past ``tolerance``. (A run's engines: ``EnginePool.probe``.)"""
    from sparse_rl_megatron.trainer.engine_pool import EnginePool

    pool = EnginePool.single(engine, None, engine_name, spec=spec)
    try:
        return pool.probe(learner, probe, tolerance, version)
    finally:
        pool.close()
