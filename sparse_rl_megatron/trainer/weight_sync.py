"""Weight sync learner -> rollout engine, then a probe that the engine really serves the new weights.

Sync: every rank iterates the learner's HF-named buckets (``Learner.export_weights``, a collective); rank 0
hands the stream of buckets to its engine (one ``update_weights(buckets, version)`` call), which moves each its
own way (tensors in process, a broadcast to separate engine GPUs, or files it reloads). Probe: the learner's
dense log-probs of a fixed sequence (drawn once from the run's seed) against the engine's dense log-probs of the
same sequence (compression off); a difference past the tolerance is an error naming the engine, since training
on samples from stale or garbled weights would be silently off-policy.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sparse_rl_megatron.trainer import distributed as D

if TYPE_CHECKING:
    from sparse_rl_megatron.learner.batch import SequenceBatch

MIB = 1024 * 1024
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
    """Push the learner's weights to ``engine`` (rank 0; None elsewhere) as weight ``version``. Collective.

    The engine gets every bucket in one ``update_weights`` call, as a lazy stream (one bucket alive at a time;
    an engine that reloads a whole model, e.g. SGLang's ``disk`` sync, sees the complete set)."""
    t0 = time.perf_counter()
    stats = {"buckets": 0, "bytes": 0}

    def buckets():
        for bucket in learner.export_weights(bucket_bytes=bucket_mb * MIB):
            stats["buckets"] += 1
            stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket

    stream = buckets()
    if engine is not None:
        engine.update_weights(stream, version=version)
    for _ in stream:  # other ranks (and an engine that stopped early) still take part in every bucket's collective
        pass
    return {"sync/seconds": time.perf_counter() - t0, "sync/buckets": float(stats["buckets"]),
            "sync/mib": stats["bytes"] / MIB}


def probe_weights(learner, engine, spec, probe: "SequenceBatch", tolerance: float, engine_name: str,
                  version: int) -> dict[str, float]:
    """Compare the engine's dense log-probs of ``probe`` with the learner's. Collective; raises
    ``WeightSyncError`` on every rank when they differ by more than ``tolerance``."""
    learner_lp = learner.logprobs(probe)
    diff = None
    if engine is not None:
        engine_lp = spec.dense_logprobs(engine, probe)
        mask = probe.response_mask()
        diff = float((engine_lp - learner_lp).abs()[mask].max())
    diff = D.broadcast_from_main(diff)
    if not diff <= tolerance:  # NaN fails too
        raise WeightSyncError(
            f"rollout engine '{engine_name}' does not serve the learner's weights (version {version}): its dense "
            f"log-probs of the probe sequence differ from the learner's by up to {diff:.3g} > sync.probe_tolerance "
            f"{tolerance:g}")
    return {"sync/probe_max_abs_diff": diff}
