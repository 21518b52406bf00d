"""Sparsity-aware rejection sampling (Sparse-RL, arXiv 2601.10079; keys as in verl's rollout correction).

Two independent filters on the per-token ``log rho = log pi_old - log pi_sparse`` (see ``ratio.py``):

1. Sequence veto: drop the whole trajectory if ANY of its response tokens has ``rho_t < veto_threshold``
   (reference 1e-4: the dense policy finds a sampled token ~10^4 times less likely than the sparse sampler
   did, the signature of degenerate sparse output such as loops).
2. Bounds on a rejection statistic. A key turns each token's log rho into a per-token value, a level
   aggregates it over the sequence, and the bounds decide:

   ====== ============================== =========================================================
   key    per-token value                bounds
   ====== ============================== =========================================================
   k1     ``-log rho``                   ratio bounds: keep iff ``lower <= exp(-value) <= upper``
   k2     ``(log rho)^2 / 2``            keep iff ``value <= max_divergence``
   k3     ``rho - 1 - log rho``          keep iff ``value <= max_divergence``
   ====== ============================== =========================================================

   levels: ``token`` (each token on its own; rejects single tokens), ``sequence`` (masked sum over the
   sequence; for k1 that is the product of ratios), ``geometric`` (masked mean; for k1 the geometric mean
   of the ratios). Sequence and geometric levels reject whole sequences.

The reference Sparse-RL run is ``level=token, key=k1, lower=0.5, upper=1.5, veto_threshold=1e-4``.
Bounds are inclusive (rho == 1.5 is kept). Nothing here edits its inputs: a NEW mask is returned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from sparse_rl_megatron.algo.validation import as_bool_mask, check_2d, check_same_shape
from sparse_rl_megatron.utils.registry import Registry

REJECTION_KEYS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("rejection key")
REJECTION_LEVELS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("rejection level")

RATIO_KEY = "k1"
"""The key whose bounds are ratio bounds ``[lower, upper]``; the others take ``max_divergence``."""


@REJECTION_KEYS.register("k1")
def _k1(log_rho: torch.Tensor) -> torch.Tensor:
    return -log_rho


@REJECTION_KEYS.register("k2")
def _k2(log_rho: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_rho.square()


@REJECTION_KEYS.register("k3")
def _k3(log_rho: torch.Tensor) -> torch.Tensor:
    # expm1 keeps precision for rho near 1, where k3 ~ (log rho)^2 / 2 is tiny.
    return torch.expm1(log_rho) - log_rho


@REJECTION_LEVELS.register("token")
def _token_level(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values


@REJECTION_LEVELS.register("sequence")
def _sequence_level(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    total = torch.where(mask, values, torch.zeros_like(values)).sum(dim=-1, keepdim=True)
    return total.expand_as(values)


@REJECTION_LEVELS.register("geometric")
def _geometric_level(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    total = torch.where(mask, values, torch.zeros_like(values)).sum(dim=-1, keepdim=True)
    count = mask.sum(dim=-1, keepdim=True).clamp_min(1)
    return (total / count).expand_as(values)


@dataclass
class RejectionResult:
    """What rejection decided; all tensors are new (inputs untouched)."""

    mask: torch.Tensor
    """``[B, T]`` bool: response tokens that survive (input mask AND bounds AND not vetoed)."""
    keep: torch.Tensor
    """``[B]`` bool: the sample still has at least one surviving token (so it trains and counts in advantages)."""
    vetoed: torch.Tensor
    """``[B]`` bool: the sample was dropped by the sequence veto."""
    out_of_bounds: torch.Tensor
    """``[B, T]`` bool: response tokens whose rejection statistic is outside the bounds (before the veto)."""


def sequence_veto(log_rho: torch.Tensor, mask: torch.Tensor, threshold: float | None = 1e-4) -> torch.Tensor:
    """``[B]`` bool: True where some masked token has ``rho_t < threshold``. ``threshold`` None or 0: no veto.

    Args:
        log_rho: ``[B, T]`` per-token log rho (``ratio.sparsity_log_ratio``).
        mask: ``[B, T]`` bool or 0/1 response mask.
        threshold: veto below this ratio; must be in [0, 1) (0 or None disables).
    """
    check_2d(log_rho, "log_rho")
    check_same_shape("log_rho", log_rho, mask=mask)
    mask = as_bool_mask(mask)
    if threshold is None or threshold == 0:
        return torch.zeros(log_rho.shape[0], dtype=torch.bool, device=log_rho.device)
    if not 0 < threshold < 1:
        raise ValueError(f"veto threshold must be in (0, 1) (or None/0 to disable), got {threshold}")
    # compare in log space: exp(log rho) could underflow to 0 and make the comparison meaningless
    return (mask & (log_rho < math.log(threshold))).any(dim=-1)


def reject(
    log_rho: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    key: str = "k1",
    lower: float = 0.5,
    upper: float = 1.5,
    max_divergence: float | None = None,
    veto_threshold: float | None = 1e-4,
) -> RejectionResult:
    """Apply the sequence veto and the bounds; see the module docstring for the exact rule.

    Args:
        log_rho: ``[B, T]`` per-token log rho (``ratio.sparsity_log_ratio``).
        mask: ``[B, T]`` bool or 0/1 response mask (not modified).
        level: ``token`` | ``sequence`` | ``geometric``.
        key: ``k1`` (ratio bounds ``lower``/``upper``) | ``k2`` | ``k3`` (bound ``max_divergence``).
        lower, upper: inclusive ratio bounds for key k1 (0 < lower <= 1 <= upper).
        max_divergence: inclusive upper bound for keys k2/k3 (> 0); None means no bound for them.
        veto_threshold: sequence veto on single-token rho (None/0 disables).
    """
    check_2d(log_rho, "log_rho")
    check_same_shape("log_rho", log_rho, mask=mask)
    mask = as_bool_mask(mask)
    per_token = REJECTION_KEYS.get(key)(log_rho)
    stat = REJECTION_LEVELS.get(level)(per_token, mask)
    if key == RATIO_KEY:
        if not 0 < lower <= 1 <= upper:
            raise ValueError(f"ratio bounds must satisfy 0 < lower <= 1 <= upper, got lower={lower}, upper={upper}")
        log_ratio = -stat  # log of the (token / product / geometric-mean) ratio; no exp, so no overflow
        outside = (log_ratio < math.log(lower)) | (log_ratio > math.log(upper))
    elif max_divergence is None:
        outside = torch.zeros_like(mask)
    else:
        if not max_divergence > 0:
            raise ValueError(f"max_divergence must be > 0 for key '{key}', got {max_divergence}")
        outside = stat > max_divergence
    outside = outside & mask
    vetoed = sequence_veto(log_rho, mask, veto_threshold)
    new_mask = mask & ~outside & ~vetoed.unsqueeze(-1)
    return RejectionResult(mask=new_mask, keep=new_mask.any(dim=-1), vetoed=vetoed, out_of_bounds=outside)
