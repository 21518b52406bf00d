"""The weight-sync probe: does every engine really serve the learner's new weights?

The push itself is ``EnginePool.sync`` (``pool.py``): every rank iterates the learner's HF-named buckets
(``Learner.export_weights``, a collective that gives every rank every bucket); each rank that drives an engine
hands the stream of buckets to it (``RolloutEngine.update_weights``, or ``update_weights_from_payloads`` for the
per-TP-rank CUDA-IPC handles of ``colocated_weights.py``), which moves them its own way (tensors in process, a
broadcast to separate engine GPUs, or files it reloads: ``rollout/sglang_weights.py``). The probe, here: the
learner's dense log-probs of a fixed sequence (drawn once from the run's seed) against each engine's dense
log-probs of the same sequence (compression off, ``engine_logprobs``), and each engine's weight version; a mean
difference past the tolerance, or log-probs closer to the previous version's than to the new one's
(``probe_verdict``), is an error naming the engine and its rank, since training on samples from stale or garbled
weights would be silently off-policy (``EnginePool.probe``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparse_rl_megatron.learner.batch import SequenceBatch
from sparse_rl_megatron.utils.device import DeviceFacts, resolve
from sparse_rl_megatron.utils.errors import RunFailed

if TYPE_CHECKING:
    from sparse_rl_megatron.learner.batch import SequenceBatch
    from sparse_rl_megatron.learner.learner import Learner
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.rollout.engine_protocol import RolloutEngine

PROBE_TOLERANCE_FP32 = 1e-3
"""Default probe tolerance when the engine and the learner both compute in float32: they agree to ~1e-5 in mean
|log-prob difference| on CPU (the HF engine ~1e-6, SGLang ~2e-6), so 1e-3 leaves two orders of magnitude for other
fp32 kernels (TF32 matmuls on GPUs) while a stale or garbled engine moves the mean by far more."""
PROBE_TOLERANCE_16BIT = 0.3
"""Default when either side computes in bfloat16 / float16. The statistic is the MEAN |log-prob difference| over
the probe's response tokens: bf16 rounding (8-bit mantissa, relative error 2^-8 per rounding) compounds with depth,
and its per-token maximum grows with the number of tokens, so a maximum flags noise. Measured on SmolLM2-135M-
Instruct (30 layers, its real weights: ``models/gguf_import.py``; 16-token probe responses of seeds 0-9), the HF
engine in bf16 vs float32: mean 0.041-0.142, max up to 0.41 (SGLang in bf16 on CPU vs the fp32 learner, seed 0:
mean 0.043-0.052, max up to 0.14); the same HF engine with wrong weights, one tensor's
elements shuffled (layer 0 q_proj, layer 15 o_proj, layer 29 down_proj, the final norm) or bf16 bits read as
fp16: mean 0.44 at the least (a shuffled o_proj), 2.9 to 250 for the others. Tolerance = 2 x the largest noise
mean (0.28: what the stale check in ``probe_verdict`` needs to be exact), rounded up: 0.3, below 0.44."""
SIXTEEN_BIT = ("bfloat16", "float16", "half", "bf16", "fp16")


class WeightSyncError(RunFailed):
    """The engine does not serve the learner's weights after a sync: one line naming the engine and its rank
    (a ``RunFailed``: printed without a traceback, exit status 1)."""


def probe_sequence(vocab_size: int, tokens: int, seed: int) -> "SequenceBatch":
    """One row of ``tokens`` token ids drawn from ``seed`` (first half prompt, second half response)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab_size, (tokens,), generator=gen)
    half = tokens // 2
    return SequenceBatch([ids[:half]], [ids[half:]])


def default_tolerance(engine_dtype: str, learner_dtype: "str | torch.dtype" = "float32") -> float:
    """``PROBE_TOLERANCE_16BIT`` when the engine or the learner computes in 16 bits, else ``PROBE_TOLERANCE_FP32``."""
    names = {str(engine_dtype).removeprefix("torch."), str(learner_dtype).removeprefix("torch.")}
    return PROBE_TOLERANCE_16BIT if names & set(SIXTEEN_BIT) else PROBE_TOLERANCE_FP32


def probe_tolerance(cfg: "TrainConfig", learner: "Learner | None" = None,
                    device_facts: DeviceFacts | None = None) -> float:
    """``sync.probe_tolerance``, else the default for the engine's dtype and the learner's (``learner`` built:
    its parameter dtype; else ``learner.params_dtype``, ``auto`` resolved for ``device_facts``, default: this
    machine)."""
    if cfg.sync.probe_tolerance:
        return cfg.sync.probe_tolerance
    if learner is not None:
        learner_dtype = learner.config.torch_params_dtype(learner.device_facts)
    else:
        learner_dtype = cfg.learner.params_dtype
        if learner_dtype == "auto":
            learner_dtype = resolve(device_facts).auto_params_dtype
    return default_tolerance(cfg.rollout.dtype, learner_dtype)


@dataclass
class ProbeResult:
    """One engine's probe against the learner: mean and largest |log-prob difference| over the probe's response
    tokens, to the current version and (when kept) to the previous one; ``problem`` is None when it passes."""

    mean_abs_diff: float
    max_abs_diff: float
    previous_mean_abs_diff: float | None = None
    problem: str | None = None


def probe_verdict(engine_lp: torch.Tensor, learner_lp: torch.Tensor, tolerance: float, version: int,
                  previous: "tuple[int, torch.Tensor] | None" = None) -> ProbeResult:
    """Whether an engine's log-probs of the probe's response tokens (``engine_lp``, ``[N]``) are the learner's at
    ``version`` (``learner_lp``, ``[N]``); ``previous``: ``(version, [N] log-probs)`` of the previous version.

    With d(a, b) = mean |a - b| over the tokens (an L1 distance: the triangle inequality holds) and engine noise
    d(engine, the weights it serves) <= tolerance / 2 (how the defaults are set):
    - stale: the two versions are apart, d(current, previous) > tolerance, and the engine is within the tolerance
      of the previous version and closer to it than to the current one. Exact both ways: a fresh engine has
      d(engine, previous) >= d(current, previous) - d(engine, current) > tolerance / 2 >= d(engine, current); a
      stale one has d(engine, current) > tolerance / 2 >= d(engine, previous). Versions closer than the tolerance
      cannot be told apart by the probe (nor does serving one for the other matter beyond the noise);
    - garbled or wrong weights: d(engine, current) > tolerance (NaN too).
    """
    engine_lp, learner_lp = engine_lp.float(), learner_lp.float()
    diff = (engine_lp - learner_lp).abs()
    mean, worst = float(diff.mean()), float(diff.max())
    result = ProbeResult(mean, worst)
    if previous is not None:
        old_version, old_lp = previous
        result.previous_mean_abs_diff = to_old = float((engine_lp - old_lp.float()).abs().mean())
        apart = float((learner_lp - old_lp.float()).abs().mean())
        if apart > tolerance and to_old <= tolerance and to_old < mean:
            result.problem = (f"it still serves version {old_version}'s weights: its dense log-probs of the probe "
                              f"sequence differ from version {old_version}'s by {to_old:.3g} on average, from "
                              f"version {version}'s by {mean:.3g} (the two versions are {apart:.3g} apart; "
                              f"sync.probe_tolerance {tolerance:g})")
            return result
    if not mean <= tolerance:  # NaN fails too
        result.problem = (f"its dense log-probs of the probe sequence differ from the learner's by {mean:.3g} on "
                          f"average (up to {worst:.3g}) > sync.probe_tolerance {tolerance:g}: garbled or wrong "
                          "weights")
    return result


def engine_logprobs(engine: "RolloutEngine", seqs: "SequenceBatch") -> torch.Tensor:
    """``[B, T]`` log-probs of each row's response tokens under ``engine`` with full attention, 0 at padding (rows
    without a response are not sent to the engine)."""
    keep = [i for i, r in enumerate(seqs.responses) if r.numel() > 0]
    scored = engine.dense_logprobs([seqs.prompts[i].tolist() for i in keep], [seqs.responses[i].tolist() for i in keep])
    out = torch.zeros(len(seqs), seqs.max_response_len, dtype=torch.float32)
    for i, row in zip(keep, scored):
        out[i, : row.numel()] = row
    return out
