"""The data half of a Sparse-RL step: rollout -> reward -> dense recompute (+ reference) -> correction.

``collect_samples`` runs on rank 0 (engine and reward live there); ``prepare_batch`` on every rank (it calls
the learner's collectives). ``rollout_step`` chains them with the broadcast in between. Other commands that
need the same tensors without training (e.g. a mismatch study) call these functions, not a copy of them.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from sparse_rl_megatron.trainer import distributed as D
from sparse_rl_megatron.utils.errors import UserError

if TYPE_CHECKING:
    from sparse_rl_megatron.algo import CorrectionConfig, PreparedBatch
    from sparse_rl_megatron.data.record import MathRecord
    from sparse_rl_megatron.learner.batch import SequenceBatch
    from sparse_rl_megatron.rollout.engine import SamplingParams
    from sparse_rl_megatron.rollout.sample import Sample


class EngineError(RuntimeError):
    """The rollout engine failed; the message names it and the step."""


@dataclass
class RolloutBatch:
    """One rollout step's samples and everything the optimizer steps need, identical on every rank."""

    samples: list["Sample"]
    """Group-major samples with rewards and provenance."""
    sequences: "SequenceBatch"
    """Their prompt + response token rows."""
    prepared: "PreparedBatch"
    """``prepare_correction`` output over the whole batch (``[B, T]``)."""
    ref_log_probs: torch.Tensor | None = None
    """``[B, T]`` reference-policy log-probs (KL on), else None."""
    metrics: dict[str, float] = field(default_factory=dict)
    """rollout/*, sparse/*, time/* metrics of this step."""

    @property
    def trainable(self) -> bool:
        """False when correction rejected every sample (nothing to train on)."""
        return bool(self.prepared.keep.any())


def step_seed(seed: int, step: int) -> int:
    """The sampler seed of rollout step ``step`` (a pure function: a resumed run samples what the whole run would)."""
    return seed * 1_000_003 + step


def collect_samples(engine, reward, records: Sequence["MathRecord"], template: str, n: int,
                    sampling: "SamplingParams", engine_name: str, step: int) -> tuple[list["Sample"], dict[str, float]]:
    """Rank 0: ``n`` samples per record from ``engine``, scored by ``reward``; returns them and their metrics."""
    from sparse_rl_megatron.data.templates import render_prompt
    from sparse_rl_megatron.rollout.repetition import repetition_metrics

    t0 = time.perf_counter()
    prompts = [render_prompt(template, r.prompt, getattr(engine, "tokenizer", None)) for r in records]
    try:
        samples = engine.generate(prompts, n, sampling)
    except UserError:
        raise  # already one line naming what failed (e.g. an engine process that died: RunFailed)
    except Exception as err:
        raise EngineError(f"rollout engine '{engine_name}' failed while generating step {step}: "
                          f"{type(err).__name__}: {err}") from err
    if len(samples) != len(records) * n:
        raise EngineError(f"rollout engine '{engine_name}' returned {len(samples)} samples for {len(records)} "
                          f"prompts x n={n} at step {step}")
    t1 = time.perf_counter()
    for s in samples:
        s.metadata.update(records[s.group_id].metadata())
    reward.score_samples(samples)
    t2 = time.perf_counter()
    metrics = rollout_metrics(samples)
    metrics.update(repetition_metrics(samples))
    metrics.update({"time/rollout_s": t1 - t0, "time/reward_s": t2 - t1,
                    "throughput/rollout_tokens_per_s": sum(s.response_length for s in samples) / max(t1 - t0, 1e-9)})
    return samples, metrics


def rollout_metrics(samples: Sequence["Sample"]) -> dict[str, float]:
    """Rewards, lengths, compression and KV memory of a batch of samples (provenance included)."""
    count = len(samples)
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    lengths = torch.tensor([float(s.response_length) for s in samples])
    dense_kv = torch.tensor([float(len(s.prompt_ids) + s.response_length) for s in samples])
    peak_kv = torch.tensor([float(s.compression.peak_kv_tokens) for s in samples])
    groups: dict[int, list[float]] = {}
    for s, r in zip(samples, rewards.tolist()):
        groups.setdefault(s.group_id, []).append(r)
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/groups_with_signal_frac": sum(max(g) > min(g) for g in groups.values()) / len(groups),
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / count,
        "rollout/compression_events_mean": sum(s.compression.events for s in samples) / count,
        "rollout/kv_tokens_peak_mean": float(peak_kv.mean()),
        "rollout/kv_tokens_dense_mean": float(dense_kv.mean()),
        "rollout/kv_retained_frac": float((peak_kv / dense_kv).mean()),
        "rollout/weight_version": float(min(s.weight_version for s in samples)),
    }


def prepare_batch(learner, samples: list["Sample"], correction: "CorrectionConfig", ref_learner=None
                  ) -> RolloutBatch:
    """Every rank: dense old log-probs (and reference log-probs) of ``samples``, then the Sparse-RL correction
    on the whole batch. Collective (the learner's)."""
    from sparse_rl_megatron.algo import prepare_correction
    from sparse_rl_megatron.algo.hooks import pad
    from sparse_rl_megatron.learner.batch import SequenceBatch

    t0 = time.perf_counter()
    seqs = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    old = learner.logprobs(seqs)  # [B, T]
    t1 = time.perf_counter()
    ref = ref_learner.logprobs(seqs) if ref_learner is not None else None
    t2 = time.perf_counter()
    sampler, _ = pad([s.sampler_logprobs for s in samples])  # [B, T], T = seqs.max_response_len
    prepared = prepare_correction(
        old, sampler, seqs.response_mask(), torch.tensor([float(s.reward) for s in samples]),
        torch.tensor([s.group_id for s in samples]), correction)
    metrics = {**prepared.metrics, "time/recompute_s": t1 - t0}
    if ref is not None:
        metrics["time/ref_s"] = t2 - t1
    return RolloutBatch(samples, seqs, prepared, ref, metrics)


def rollout_step(*, learner, engine, reward, records, template: str, n: int, sampling: "SamplingParams",
                 correction: "CorrectionConfig", seed: int, step: int, engine_name: str, ref_learner=None
                 ) -> RolloutBatch:
    """Rollout (rank 0) -> broadcast -> recompute and correction (every rank) for rollout step ``step``."""
    sampling = dataclasses.replace(sampling, seed=step_seed(seed, step))
    samples, metrics = D.on_main(
        lambda: collect_samples(engine, reward, records, template, n, sampling, engine_name, step))
    batch = prepare_batch(learner, samples, correction, ref_learner)
    batch.metrics = {**metrics, **batch.metrics}
    return batch
