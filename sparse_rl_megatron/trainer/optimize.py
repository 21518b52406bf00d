"""The optimizer steps of one rollout step: the rollout batch cut into ``global_batch_size`` slices.

Slices are contiguous in the group-major batch (whole GRPO groups when the slice size is a multiple of the
group size); each is one ``Learner.train_step``, whose loss is normalised over that slice's kept tokens and
samples (each optimizer step is its own global batch). A slice with no training token left after rejection is
skipped (an optimizer step on nothing would still move Adam's moments and apply weight decay), but the lr
schedule still moves on one step, so a corrected run follows the same schedule as an uncorrected one; a rollout
whose every sample was rejected trains not at all, and says so in its metrics.
"""
from __future__ import annotations

from typing import TYPE_CHECKING
from sparse_rl_megatron.learner import TrainBatch
from sparse_rl_megatron.learner.batch import SequenceBatch
from sparse_rl_megatron.observability import metric_names as MN

if TYPE_CHECKING:
    from sparse_rl_megatron.trainer.step import RolloutBatch

LAST_VALUE_KEYS = (MN.TRAIN_STEP, MN.TRAIN_SKIPPED_TOTAL, MN.TRAIN_LR)
"""Learner counters reported as their value after the last optimizer step; other metrics are averaged."""
SUMMED_KEYS = (MN.TRAIN_SKIPPED, MN.TRAIN_TOKENS)


def optimizer_steps(learner, batch: "RolloutBatch", num_steps: int, progress: bool = False) -> dict[str, float]:
    """Run ``num_steps`` optimizer steps on equal slices of ``batch``; returns ``train/*`` and ``loss/*`` metrics
    (identical on every rank). Collective."""
    size = len(batch.samples) // num_steps
    per_step: list[dict[str, float]] = []
    empty = 0
    lr = None
    bar = _bar(num_steps, progress)
    for i in range(num_steps):
        rows = list(range(i * size, (i + 1) * size))
        prepared = batch.prepared.select(rows)
        if not bool(prepared.keep.any()):
            empty += 1
            lr = learner.advance_schedule()
        else:
            routes = batch.sequences.routes
            seqs = SequenceBatch([batch.sequences.prompts[r] for r in rows], [batch.sequences.responses[r] for r in rows],
                                 None if routes is None else [routes[r] for r in rows])
            ref = None if batch.ref_log_probs is None else batch.ref_log_probs[rows]
            per_step.append(learner.train_step(TrainBatch(seqs, prepared, ref)))
            lr = per_step[-1].get(MN.TRAIN_LR, lr)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    metrics = aggregate(per_step)
    if lr is not None:  # the lr after the last slice, trained or not
        metrics[MN.TRAIN_LR] = lr
    metrics.update({MN.TRAIN_OPTIMIZER_STEPS: float(len(per_step)), MN.TRAIN_EMPTY_SLICES: float(empty),
                    MN.TRAIN_ALL_REJECTED: 0.0 if batch.trainable else 1.0})
    return metrics


def aggregate(per_step: list[dict[str, float]]) -> dict[str, float]:
    """One record for several optimizer steps: counters as their last value, sums, else the mean."""
    out: dict[str, float] = {}
    for key in {k for m in per_step for k in m}:
        values = [m[key] for m in per_step if key in m]
        if key in LAST_VALUE_KEYS:
            out[key] = values[-1]
        elif key in SUMMED_KEYS:
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    if per_step and MN.TRAIN_GRAD_NORM in out:
        out[MN.TRAIN_GRAD_NORM_MAX] = max(m[MN.TRAIN_GRAD_NORM] for m in per_step)
    return out


def _bar(total: int, progress: bool):
    if not progress or total < 2:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="optimizer steps", leave=False)
