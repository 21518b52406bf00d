"""The micro-batch loss: current log-probs + a ``PreparedBatch`` slice (with its global normalisers).

Per token (kept tokens only; everything else contributes exactly 0, gradient included)::

    x_t = ppo_clip(r_t = pi_theta / pi_old, A) * w_t  +  kl_coef * KL_t  -  entropy_coef * H_t

with ``w_t`` the raw weight times the GLOBAL normalisation factor, then reduced by name with the GLOBAL
denominator (``reductions.py``). The result is this micro-batch's share of the global loss: summed over all
micro-batches and data-parallel ranks it is the full-batch loss, and the accumulated gradient is the
full-batch gradient. If the framework AVERAGES gradients over micro-batches or data-parallel ranks
(Megatron's DDP averages over DP by default), multiply the loss by that count to undo it.

Metrics are tensors pre-normalised the same way: SUM them over micro-batches and ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_rl_megatron.algo.correction import PreparedBatch
from sparse_rl_megatron.algo.kl import KL_ESTIMATORS, kl_penalty
from sparse_rl_megatron.algo.policy_loss import ppo_clip_loss
from sparse_rl_megatron.algo.reductions import REDUCTIONS, reduce_loss
from sparse_rl_megatron.algo.reweighting import normalise_weights
from sparse_rl_megatron.algo.validation import check_2d, check_finite_where, check_same_shape
from sparse_rl_megatron.observability import metric_names as MN


@dataclass
class LossConfig:
    """The policy loss of one micro-batch."""

    eps_clip_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - eps_clip_low."""
    eps_clip_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + eps_clip_high (DAPO's clip-higher when > eps_clip_low)."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the reference policy (reference runs: 1e-4; 0 needs no ref model)."""
    kl_estimator: str = "low_var_kl"
    """KL estimator: ``k1``, ``k2``, ``low_var_kl`` (= ``k3``)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (reference runs: 0)."""
    reduction: str = "seq_mean_token_mean"
    """Loss reduction: ``seq_mean_token_mean`` (reference), ``token_mean``, ``seq_mean_token_sum``."""
    check_finite: bool = True
    """Raise on NaN/inf current log-probs at kept tokens (one device sync per micro-batch)."""

    def __post_init__(self) -> None:
        KL_ESTIMATORS.check(self.kl_estimator, "LossConfig.kl_estimator")
        REDUCTIONS.check(self.reduction, "LossConfig.reduction")
        if not 0 <= self.eps_clip_low < 1:
            raise ValueError(f"LossConfig.eps_clip_low must be in [0, 1), got {self.eps_clip_low}")
        if not self.eps_clip_high >= 0:
            raise ValueError(f"LossConfig.eps_clip_high must be >= 0, got {self.eps_clip_high}")
        if not self.kl_coef >= 0:
            raise ValueError(f"LossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"LossConfig.entropy_coef must be >= 0, got {self.entropy_coef}")

    @classmethod
    def reference(cls) -> "LossConfig":
        """The Sparse-RL reference runs: clip 0.2, low_var_kl with coefficient 1e-4, no entropy bonus."""
        return cls(kl_coef=1e-4, kl_estimator="low_var_kl")


def micro_batch_loss(
    log_probs: torch.Tensor,
    batch: PreparedBatch,
    config: LossConfig | None = None,
    *,
    ref_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its pre-normalised metrics.

    Args:
        log_probs: ``[b, T]`` CURRENT log pi_theta of the response tokens (carries the gradient).
        batch: the micro-batch slice of ``prepare_correction``'s output (rows aligned with ``log_probs``).
        config: ``LossConfig`` (None: defaults).
        ref_log_probs: ``[b, T]`` reference-policy log-probs; required when ``kl_coef > 0``.
        entropy: ``[b, T]`` token entropies of pi_theta; required when ``entropy_coef > 0``.

    Returns:
        ``(loss, metrics)``: scalar loss share; metrics ``loss/{total,pg,kl,entropy,clip_frac,
        clip_frac_all_tokens,ppo_kl}`` as 0-dim detached tensors, each to be SUMMED over micro-batches
        and ranks. ``clip_frac`` is over training tokens (the paper's clip ratio), ``clip_frac_all_tokens``
        over all response tokens (unmodified mask).
    """
    config = config or LossConfig()
    check_2d(log_probs, "log_probs")
    check_same_shape("log_probs", log_probs, old_log_probs=batch.old_log_probs, ref_log_probs=ref_log_probs,
                     entropy=entropy)
    mask, response = batch.loss_mask.to(log_probs.device), batch.response_mask.to(log_probs.device)
    if config.check_finite:
        check_finite_where(log_probs.detach(), mask, "log_probs")
    weights = batch.weights.to(log_probs.device)
    if batch.normalise_weights:
        weights = normalise_weights(weights, mask, batch.normalisers.weight_stats())
    pg, clipped = ppo_clip_loss(
        log_probs, batch.old_log_probs.to(log_probs.device), batch.advantages.to(log_probs.device), mask,
        eps_low=config.eps_clip_low, eps_high=config.eps_clip_high, weights=weights,
    )
    # clip fraction on the unmodified mask: the same PPO test, on every response token
    _, clipped_all = ppo_clip_loss(
        log_probs.detach(), batch.old_log_probs.to(log_probs.device), batch.advantages.to(log_probs.device), response,
        eps_low=config.eps_clip_low, eps_high=config.eps_clip_high,
    )
    denom = batch.normalisers.denominator(REDUCTIONS.get(config.reduction).unit)
    pg_loss = reduce_loss(config.reduction, pg, mask, denom)
    total = pg_loss
    metrics = {MN.LOSS_PG: pg_loss.detach()}
    if config.kl_coef > 0:
        if ref_log_probs is None:
            raise ValueError(f"LossConfig.kl_coef={config.kl_coef} needs ref_log_probs (or set kl_coef=0)")
        kl = reduce_loss(config.reduction, kl_penalty(log_probs, ref_log_probs, mask, config.kl_estimator), mask, denom)
        total = total + config.kl_coef * kl
        metrics[MN.LOSS_KL] = kl.detach()
    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError(f"LossConfig.entropy_coef={config.entropy_coef} needs entropy (or set entropy_coef=0)")
        ent = reduce_loss(config.reduction, torch.where(mask, entropy, torch.zeros_like(entropy)), mask, denom)
        total = total - config.entropy_coef * ent
        metrics[MN.LOSS_ENTROPY] = ent.detach()
    n_kept = max(batch.normalisers.kept_tokens, 1.0)
    n_resp = max(batch.normalisers.response_tokens, 1.0)
    ppo_kl = torch.where(mask, batch.old_log_probs.to(log_probs.device) - log_probs.detach(), torch.zeros_like(log_probs))
    metrics[MN.LOSS_TOTAL] = total.detach()
    metrics[MN.LOSS_CLIP_FRAC] = clipped.sum().to(torch.float64) / n_kept
    metrics[MN.LOSS_CLIP_FRAC_ALL_TOKENS] = clipped_all.sum().to(torch.float64) / n_resp
    metrics[MN.LOSS_PPO_KL] = ppo_kl.sum().to(torch.float64) / n_kept
    return total, metrics
