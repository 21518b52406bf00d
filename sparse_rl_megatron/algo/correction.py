"""Once per rollout, on the GLOBAL batch: turn log-probs, masks and rewards into train-time tensors.

``prepare_correction`` runs ratio -> the correction mode (``modes.py``: rejection, reweighting, a hook) ->
advantages (over kept samples) -> global normalisers -> metrics, and returns a ``PreparedBatch``. The learner
slices it into micro-batches (``PreparedBatch.select`` / ``micro_batches``) and calls ``loss.micro_batch_loss`` on each; the global
normalisers travel with every slice.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sparse_rl_megatron.algo.advantages import compute_advantages
from sparse_rl_megatron.algo.config import CorrectionConfig
from sparse_rl_megatron.algo.diagnostics import rollout_diagnostics
from sparse_rl_megatron.algo.metrics import mismatch_metrics
from sparse_rl_megatron.algo.modes import CORRECTION_MODES, CorrectionInputs
from sparse_rl_megatron.algo.normalisers import GlobalNormalisers, local_normalisers
from sparse_rl_megatron.algo.ratio import sparsity_log_ratio
from sparse_rl_megatron.algo.reweighting import normalisation_factor
from sparse_rl_megatron.algo.validation import (
    as_bool_mask,
    check_2d,
    check_finite_where,
    check_per_sample,
    check_same_shape,
)
from sparse_rl_megatron.observability import metric_names as MN


@dataclass
class PreparedBatch:
    """Train-time tensors of a rollout batch (or of a micro-batch slice of it). Shapes ``[B, T]`` / ``[B]``."""

    old_log_probs: torch.Tensor
    """``[B, T]`` dense old log-probs (the PPO ratio's denominator), 0 at padding."""
    response_mask: torch.Tensor
    """``[B, T]`` bool, the ORIGINAL response mask (for metrics on unmodified masks)."""
    loss_mask: torch.Tensor
    """``[B, T]`` bool, tokens that train (after veto, rejection and mode-``mask`` weights)."""
    advantages: torch.Tensor
    """``[B]`` per-sample advantages over kept samples (0 for dropped samples)."""
    weights: torch.Tensor
    """``[B, T]`` RAW importance weights, detached, 0 off ``loss_mask`` (1 on it when not reweighting)."""
    keep: torch.Tensor
    """``[B]`` bool, sample has at least one training token."""
    log_rho: torch.Tensor
    """``[B, T]`` clamped log(pi_old / pi_sparse), 0 at padding (all 0 without sampler log-probs)."""
    normalisers: GlobalNormalisers
    """Sums over the WHOLE global batch; identical in every slice."""
    normalise_weights: bool = True
    """Whether ``micro_batch_loss`` scales the weights to mean 1 with ``normalisers``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Rollout-level metrics (``sparse/*``, ``hook/*``), computed on the global batch."""

    @property
    def batch_size(self) -> int:
        return int(self.loss_mask.shape[0])

    def select(self, index: slice | torch.Tensor | list[int]) -> "PreparedBatch":
        """Rows ``index`` (a micro-batch); global normalisers and metrics are kept as they are."""
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long, device=self.loss_mask.device)
        return replace(
            self,
            old_log_probs=self.old_log_probs[index],
            response_mask=self.response_mask[index],
            loss_mask=self.loss_mask[index],
            advantages=self.advantages[index],
            weights=self.weights[index],
            keep=self.keep[index],
            log_rho=self.log_rho[index],
        )

    def without_tokens(self) -> "PreparedBatch":
        """The same rows contributing nothing: every mask False, weights 0, no sample kept (the part of a
        padding micro-batch, whose loss share, gradient and metrics must be exactly 0)."""
        return replace(self, loss_mask=torch.zeros_like(self.loss_mask), response_mask=torch.zeros_like(
            self.response_mask), weights=torch.zeros_like(self.weights), keep=torch.zeros_like(self.keep))

    def micro_batches(self, num: int) -> list["PreparedBatch"]:
        """Split rows into ``num`` contiguous slices of (almost) equal size."""
        if not 1 <= num <= self.batch_size:
            raise ValueError(f"num micro-batches must be in [1, {self.batch_size}], got {num}")
        bounds = [round(i * self.batch_size / num) for i in range(num + 1)]
        return [self.select(slice(bounds[i], bounds[i + 1])) for i in range(num)]

    def to(self, device: torch.device | str) -> "PreparedBatch":
        return replace(self, **{k: getattr(self, k).to(device) for k in (
            "old_log_probs", "response_mask", "loss_mask", "advantages", "weights", "keep", "log_rho")})


def prepare_correction(
    old_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor | None,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    config: CorrectionConfig | None = None,
) -> PreparedBatch:
    """Correct a GLOBAL rollout batch for the sparse sampler.

    Args:
        old_log_probs: ``[B, T]`` log pi_old of the sampled response tokens (dense recompute, old weights).
        sampler_log_probs: ``[B, T]`` log pi_sparse from the rollout engine; may be None only in mode ``none``.
        mask: ``[B, T]`` bool or 0/1, real response tokens.
        rewards: ``[B]`` outcome rewards; group_ids: ``[B]`` integer GRPO group of each sample.
        config: ``CorrectionConfig`` (None: reference defaults).

    Returns:
        ``PreparedBatch``. Safe results: a sample with an empty mask (or everything rejected) has keep False,
        advantage 0 and no training token; a batch with no training token at all gives loss 0.

    Raises:
        ValueError / TypeError: mismatched shapes, non-finite log-probs or rewards at real tokens, bad masks,
        empty batch (B == 0), missing sampler log-probs; UnknownNameError via the config for unknown names.
    """
    config = config or CorrectionConfig()
    mode = CORRECTION_MODES.get(config.mode)
    check_2d(old_log_probs, "old_log_probs")
    check_same_shape("old_log_probs", old_log_probs, sampler_log_probs=sampler_log_probs, mask=mask)
    batch = old_log_probs.shape[0]
    if batch == 0:
        raise ValueError("empty rollout batch (B == 0): nothing to prepare")
    check_per_sample(rewards, "rewards", batch)
    check_per_sample(group_ids, "group_ids", batch)
    response = as_bool_mask(mask)
    check_finite_where(old_log_probs, response, "old_log_probs")
    if sampler_log_probs is None and mode.needs_sampler:
        raise ValueError(f"correction mode '{config.mode}' needs sampler_log_probs (only mode 'none' runs without)")
    old = torch.where(response, old_log_probs.detach(), torch.zeros_like(old_log_probs))

    if sampler_log_probs is None:
        log_rho = torch.zeros_like(old)
    else:
        log_rho = sparsity_log_ratio(old_log_probs, sampler_log_probs, response)
    correction = mode(CorrectionInputs(log_rho, response, old, sampler_log_probs), config)
    loss_mask, vetoed, weights = correction.loss_mask, correction.vetoed, correction.weights

    keep = loss_mask.any(dim=-1)
    advantages = compute_advantages(
        rewards, group_ids, keep, estimator=config.advantage_estimator, eps=config.advantage_eps
    )
    normalisers = local_normalisers(loss_mask, response, weights)
    factor = float(normalisation_factor(normalisers.weight_stats())) if config.normalise_weights else 1.0
    metrics: dict[str, Any] = {}
    if sampler_log_probs is not None:
        metrics.update(mismatch_metrics(
            log_rho=log_rho, old_log_probs=old_log_probs, sampler_log_probs=sampler_log_probs,
            response_mask=response, loss_mask=loss_mask, vetoed=vetoed, weights=weights,
            weight_norm_factor=factor, ratio_lower=config.rejection_lower, ratio_upper=config.rejection_upper,
            weight_upper=config.weight_upper,
        ))
        metrics.update(rollout_diagnostics(
            log_rho=log_rho, old_log_probs=old_log_probs, sampler_log_probs=sampler_log_probs, response_mask=response,
            keep=keep, rewards=rewards, veto_threshold=config.veto_threshold,
        ))
    metrics.update(correction.metrics)
    metrics[MN.SPARSE_KEPT_SEQS] = normalisers.kept_seqs
    metrics[MN.SPARSE_KEPT_TOKENS] = normalisers.kept_tokens
    return PreparedBatch(
        old_log_probs=old,
        response_mask=response,
        loss_mask=loss_mask,
        advantages=advantages,
        weights=weights,
        keep=keep,
        log_rho=log_rho,
        normalisers=normalisers,
        normalise_weights=config.normalise_weights,
        metrics=metrics,
    )
