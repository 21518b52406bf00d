"""The data half of a Sparse-RL step: rollout -> reward -> dense recompute (+ reference) -> correction.

The rollout and reward run on every engine of the run, each on its share of the groups
(``EnginePool.generate``); ``prepare_batch`` runs on every rank (it calls the learner's collectives).
``rollout_step`` chains them. Other commands that need the same tensors without training (e.g. a mismatch
study) call these functions, not a copy of them.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sparse_rl_megatron.algo import prepare_correction
from sparse_rl_megatron.algo.hooks import pad
from sparse_rl_megatron.learner.batch import SequenceBatch
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.trainer.engine_pool.pool import EngineError, EnginePool, rollout_metrics

if TYPE_CHECKING:
    from sparse_rl_megatron.algo import CorrectionConfig, PreparedBatch
    from sparse_rl_megatron.data.record import MathRecord
    from sparse_rl_megatron.learner import Learner
    from sparse_rl_megatron.learner.batch import SequenceBatch
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.sample import Sample

__all__ = ["EngineError", "RolloutBatch", "prepare_batch", "rollout_metrics", "rollout_samples", "rollout_step",
           "step_seed"]


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


def prepare_batch(learner, samples: list["Sample"], correction: "CorrectionConfig", ref_learner=None
                  ) -> RolloutBatch:
    """Every rank: dense old log-probs (and reference log-probs) of ``samples``, then the Sparse-RL correction
    on the whole batch. Collective (the learner's)."""
    t0 = time.perf_counter()
    routes = None
    if getattr(learner, "routing_replay", False):  # R3: the recompute and the training forward take the sampler's experts
        missing = sum(s.routed_experts is None for s in samples)
        if missing:
            raise ValueError(f"learner.moe.routing_replay=true but {missing} of {len(samples)} samples carry no "
                             "routed experts (the engine did not record them); valid: rollout.engine=hf, or "
                             "routing_replay=false")
        routes = [s.routed_experts for s in samples]
    seqs = SequenceBatch([torch.tensor(s.prompt_ids, dtype=torch.long) for s in samples],
                         [torch.tensor(s.response_ids, dtype=torch.long) for s in samples], routes)
    old = learner.logprobs(seqs)  # [B, T]
    t1 = time.perf_counter()
    ref = ref_learner.logprobs(seqs) if ref_learner is not None else None
    t2 = time.perf_counter()
    sampler, _ = pad([s.sampler_logprobs for s in samples])  # [B, T], T = seqs.max_response_len
    prepared = prepare_correction(
        old, sampler, seqs.response_mask(), torch.tensor([float(s.reward) for s in samples]),
        torch.tensor([s.group_id for s in samples]), correction)
    metrics = {**prepared.metrics, MN.TIME_RECOMPUTE_S: t1 - t0}
    if ref is not None:
        metrics[MN.TIME_REF_S] = t2 - t1
    return RolloutBatch(samples, seqs, prepared, ref, metrics)


def rollout_samples(pool: "EnginePool", records: "list[MathRecord] | None", template: str, n: int,
                    sampling: "SamplingParams", seed: int, step: int, budget: int | None = None
                    ) -> tuple[list["Sample"], dict[str, float]]:
    """Rollout and reward on every engine of ``pool`` (each scores its own samples) for rollout step ``step``,
    sampled with the step's seed. ``records`` are rank 0's (None elsewhere); ``budget``: this step's KV budget B
    (the adaptive budget's; None: the engines' own). Collective."""
    sampling = dataclasses.replace(sampling, seed=step_seed(seed, step))
    return pool.generate(records, template, n, sampling, step, budget)


def rollout_step(*, learner: "Learner", pool: "EnginePool", records: "list[MathRecord] | None", template: str,
                 n: int, sampling: "SamplingParams", correction: "CorrectionConfig", seed: int, step: int,
                 ref_learner: "Learner | None" = None, budget: int | None = None) -> RolloutBatch:
    """``rollout_samples`` -> recompute and correction (every rank) for rollout step ``step``. One engine a caller
    built itself: ``with EnginePool.single(engine, reward, name) as pool``. (``sparse-rl train`` runs the two halves
    in the engines' and the learner's turns: ``Run.rollout``.)"""
    samples, metrics = rollout_samples(pool, records, template, n, sampling, seed, step, budget)
    batch = prepare_batch(learner, samples, correction, ref_learner)
    batch.metrics = {**metrics, **batch.metrics}
    return batch
