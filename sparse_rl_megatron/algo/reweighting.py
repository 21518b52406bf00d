"""Importance-based reweighting with global batch normalisation (Sparse-RL, arXiv 2601.10079).

Per-token weight from ``rho_t = pi_old / pi_sparse`` (modes by name):

* ``truncate`` (reference): ``w = min(rho, upper)``; ``lower`` unused.
* ``mask``: ``w = rho`` inside ``[lower, upper]``; tokens outside are REMOVED from the returned mask (so
  they leave the loss denominator too, unlike slime's icepop which only zeroes their weight).
* ``clip``: ``w = clamp(rho, lower, upper)``.

Weights are detached (no gradient flows through w) and exactly 0 outside the mask.

Batch normalisation to mean 1 over the GLOBAL batch, in two steps so that the result does not depend on
how the batch is split over micro-batches and data-parallel ranks (the reference normalised per
micro-batch per rank, which makes training depend on the parallel layout)::

    stats = weight_stats(w_mb, mask_mb)            # local [sum, count], float64
    # caller: sum `stats` over all micro-batches, all-reduce(SUM) over data-parallel ranks
    w_mb = normalise_weights(w_mb, mask_mb, global_stats)   # w * count / sum
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from sparse_rl_megatron.algo.validation import as_bool_mask, check_2d, check_same_shape
from sparse_rl_megatron.utils.registry import Registry

# (rho, lower, upper) -> (weight, in_mask), all [B, T]
WeightModeFn = Callable[[torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]]
WEIGHT_MODES: Registry[WeightModeFn] = Registry("reweighting mode")


@WEIGHT_MODES.register("truncate")
def _truncate(rho: torch.Tensor, lower: float, upper: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rho.clamp(max=upper), torch.ones_like(rho, dtype=torch.bool)


@WEIGHT_MODES.register("mask")
def _mask(rho: torch.Tensor, lower: float, upper: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rho, (rho >= lower) & (rho <= upper)


@WEIGHT_MODES.register("clip")
def _clip(rho: torch.Tensor, lower: float, upper: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rho.clamp(min=lower, max=upper), torch.ones_like(rho, dtype=torch.bool)


def importance_weights(
    log_rho: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "truncate",
    lower: float = 0.5,
    upper: float = 1.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw (un-normalised) per-token importance weights.

    Args:
        log_rho: ``[B, T]`` clamped log rho (``ratio.sparsity_log_ratio``).
        mask: ``[B, T]`` bool or 0/1: tokens that may train (typically the post-rejection mask).
        mode: ``truncate`` | ``mask`` | ``clip``.
        lower, upper: bounds, ``0 <= lower <= 1 <= upper`` (``lower`` unused by ``truncate``).

    Returns:
        ``(weights [B, T], mask [B, T] bool)``: detached weights, 0 outside the returned mask; the mask is
        the input mask, minus the out-of-bounds tokens in mode ``mask``.
    """
    check_2d(log_rho, "log_rho")
    check_same_shape("log_rho", log_rho, mask=mask)
    mask = as_bool_mask(mask)
    fn = WEIGHT_MODES.get(mode)
    if not (0 <= lower <= 1 <= upper and math.isfinite(upper)):
        raise ValueError(f"weight bounds must satisfy 0 <= lower <= 1 <= upper < inf, got lower={lower}, upper={upper}")
    weights, in_mask = fn(torch.exp(log_rho.detach()), lower, upper)
    new_mask = mask & in_mask
    weights = torch.where(new_mask, weights, torch.zeros_like(weights))
    return weights.detach(), new_mask


def weight_stats(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Local ``[sum of weights, number of tokens]`` over the mask, float64 ``[2]``.

    Sum this over micro-batches and all-reduce(SUM) it over data-parallel ranks before
    ``normalise_weights``. float64 so that counts stay exact and the split-dependence of the sum's
    rounding stays far below float32 resolution.
    """
    check_same_shape("weights", weights, mask=mask)
    mask = as_bool_mask(mask)
    w = torch.where(mask, weights.detach(), torch.zeros_like(weights)).to(torch.float64)
    return torch.stack([w.sum(), mask.sum().to(torch.float64)])


def normalisation_factor(global_stats: torch.Tensor) -> torch.Tensor:
    """``count / sum`` of the global stats (float64 scalar): the factor that makes the weights average 1.

    Safe results: no tokens (count 0) or all-zero weights (sum 0) give factor 1.0 (nothing to rescale).
    """
    if global_stats.shape != (2,):
        raise ValueError(f"global_stats must be the [sum, count] tensor of weight_stats, got shape {tuple(global_stats.shape)}")
    total, count = global_stats[0], global_stats[1]
    if not bool(torch.isfinite(total)):
        raise ValueError(f"global weight sum is not finite ({total.item()}); weights must be finite")
    ok = (total > 0) & (count > 0)
    return torch.where(ok, count / torch.where(ok, total, torch.ones_like(total)), torch.ones_like(total))


def normalise_weights(weights: torch.Tensor, mask: torch.Tensor, global_stats: torch.Tensor) -> torch.Tensor:
    """Weights scaled to mean 1 over the global batch: ``w * count / sum`` (0 outside ``mask``).

    Args:
        weights: ``[B, T]`` raw weights of this micro-batch.
        mask: ``[B, T]`` bool or 0/1: the tokens the stats were computed over.
        global_stats: ``[2]`` float64 ``[sum, count]`` summed over the WHOLE global batch.

    Returns:
        ``[B, T]`` detached weights in the dtype of ``weights``.
    """
    check_same_shape("weights", weights, mask=mask)
    mask = as_bool_mask(mask)
    # the factor is computed where the stats live (CPU for prepare_correction's), then moved: no device sync
    factor = normalisation_factor(global_stats.detach()).to(weights.device)
    scaled = (weights.detach().to(torch.float64) * factor).to(weights.dtype)
    return torch.where(mask, scaled, torch.zeros_like(scaled))
