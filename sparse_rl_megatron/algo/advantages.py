"""Outcome-reward advantage estimators, computed ONLY over the samples that survive rejection.

All estimators take ``rewards [B]``, ``group_ids [B]`` (GRPO group = prompt), ``keep [B]`` and return one
advantage per sample ``[B]`` (broadcast to every response token by the loss). Samples with ``keep`` False
get advantage exactly 0 and are invisible to the others: a vetoed sample never moves another sample's
baseline or scale (the failure verl PR #6362 fixed). Groups are re-formed from the kept samples, so a group
of 8 with one vetoed sample is a group of 7. Let ``G`` be the kept samples of sample i's group, ``n = |G|``:

* ``grpo`` (DeepSeekMath GRPO, as in the reference): ``A_i = (r_i - mean_G r) / (std_G r + eps)``,
  ``eps = 1e-6``. ``std`` is the UNBIASED (Bessel, n-1) standard deviation, like ``torch.std`` used by
  slime (the reference code base) and verl, so our numbers match theirs. A group with one kept sample
  has no spread: its advantage is 0 (defined, not NaN).
* ``drgrpo`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783): ``A_i = r_i - mean_G r`` (no std division).
* ``rloo`` (leave-one-out): ``A_i = r_i - mean_{G \\ i} r = n / (n - 1) * (r_i - mean_G r)``; 0 when n = 1.
* ``reinforce`` (plain REINFORCE with a batch baseline): ``A_i = r_i - mean over ALL kept samples`` of the
  batch; groups are ignored. Pass the global rollout batch so the baseline is the global one.
"""
from __future__ import annotations

from typing import Callable

import torch

from sparse_rl_megatron.algo.validation import check_per_sample
from sparse_rl_megatron.utils.registry import Registry

ADVANTAGE_EPS = 1e-6
"""Added to the group std in ``grpo`` so that a group whose rewards are all equal gives 0, not 0/0."""

# (rewards f64 [B], group index [B] in [0, G), keep [B] bool, num_groups, eps) -> advantages f64 [B]
EstimatorFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[EstimatorFn] = Registry("advantage estimator")


def _group_sums(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _group_mean_count(rewards, index, keep, num_groups):
    k = keep.to(rewards.dtype)
    count = _group_sums(k, index, num_groups)
    mean = _group_sums(rewards * k, index, num_groups) / count.clamp_min(1)
    return mean[index], count[index]


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(rewards, index, keep, num_groups, eps):
    mean, count = _group_mean_count(rewards, index, keep, num_groups)
    centred = (rewards - mean) * keep.to(rewards.dtype)
    sq = _group_sums(centred.square(), index, num_groups)[index]
    std = torch.sqrt(sq / (count - 1).clamp_min(1))  # Bessel; n == 1 gives sq == 0 -> std 0 -> A 0
    return centred / (std + eps)


@ADVANTAGE_ESTIMATORS.register("drgrpo")
def _drgrpo(rewards, index, keep, num_groups, eps):
    mean, _ = _group_mean_count(rewards, index, keep, num_groups)
    return (rewards - mean) * keep.to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo(rewards, index, keep, num_groups, eps):
    mean, count = _group_mean_count(rewards, index, keep, num_groups)
    scale = torch.where(count > 1, count / (count - 1).clamp_min(1), torch.zeros_like(count))
    return (rewards - mean) * scale * keep.to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("reinforce")
def _reinforce(rewards, index, keep, num_groups, eps):
    k = keep.to(rewards.dtype)
    baseline = (rewards * k).sum() / k.sum().clamp_min(1)
    return (rewards - baseline) * k


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    keep: torch.Tensor | None = None,
    *,
    estimator: str = "grpo",
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """Per-sample advantages over the kept samples (see the module docstring for the exact formulas).

    Args:
        rewards: ``[B]`` outcome rewards (any real dtype; must be finite for kept samples).
        group_ids: ``[B]`` integer group of each sample (any values; need not be contiguous or sorted).
        keep: ``[B]`` bool, samples that survived rejection; None keeps all.
        estimator: ``grpo`` | ``drgrpo`` | ``rloo`` | ``reinforce``.
        eps: added to the group std by ``grpo``.

    Returns:
        ``[B]`` advantages, exactly 0 where ``keep`` is False; dtype of ``rewards`` if floating, else float32.
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B], got {getattr(rewards, 'shape', type(rewards).__name__)}")
    batch = rewards.shape[0]
    check_per_sample(group_ids, "group_ids", batch)
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool or group_ids.is_complex():
        raise TypeError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if keep is None:
        keep = torch.ones(batch, dtype=torch.bool, device=rewards.device)
    check_per_sample(keep, "keep", batch)
    keep = keep.to(torch.bool)
    r = rewards.to(torch.float64)
    bad = keep & ~torch.isfinite(r)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"rewards must be finite for kept samples; rewards[{i}] = {rewards[i].item()}")
    r = torch.where(keep, r, torch.zeros_like(r))  # a dropped sample's reward is never read
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1 if batch else 0
    adv = fn(r, index, keep, num_groups, eps)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return torch.where(keep, adv, torch.zeros_like(adv)).to(out_dtype)
