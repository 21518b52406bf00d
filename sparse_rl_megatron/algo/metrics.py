"""Mismatch and correction metrics of one rollout batch, on the UNMODIFIED response masks.

Every fraction is over the tokens / sequences as they came from the sampler, so rejected samples are
counted (the reference computed several of these on post-rejection masks, where they read ~0, and logged
an inverted veto count). Keys (all floats):

======================================  =====================================================================
``sparse/num_seqs``                     samples with at least one response token
``sparse/rejected_seq_frac``            ... of which no token survived (vetoed or all tokens rejected)
``sparse/vetoed_seq_frac``              ... of which the sequence veto fired (rho_t < veto threshold; mode
                                        ``custom``: the hook dropped every token, for whatever reason)
``sparse/rejected_token_frac``          response tokens not in the final loss mask (any reason)
``sparse/token_below_frac``             response tokens with rho < rejection lower bound
``sparse/token_above_frac``             response tokens with rho > rejection upper bound
``sparse/truncated_frac``               response tokens with rho > weight upper bound (truncated / clipped)
``sparse/rho_mean|min|max|p1|p5|p50``   statistics of rho over response tokens (p = linear-interpolated quantile)
``sparse/kl_k1``, ``sparse/kl_k3``      token-mean of ``-log rho`` and ``rho - 1 - log rho``: KL(sparse || old)
``sparse/kl_old_sparse_k1|k3``          token-mean of ``rho log rho`` and ``1 - rho + rho log rho``: KL(old || sparse)
``sparse/log_ppl_old|sparse``           token-mean negative log-prob under pi_old / pi_sparse
``sparse/log_ppl_diff``                 ``log_ppl_old - log_ppl_sparse``
``sparse/weight_mean``                  mean raw weight over kept tokens (before normalisation)
``sparse/weight_norm_factor``           global normalisation factor ``count / sum`` (1.0 when off)
``sparse/ess``                          effective sample size fraction ``(sum w)^2 / (N sum w^2)`` of kept weights
======================================  =====================================================================

``prepare_correction`` adds ``diagnostics.rollout_diagnostics`` (the would-be veto in every mode, kept vs vetoed
rewards, veto rate by response length, T = 1 entropies).

KL direction: the tokens were sampled from pi_sparse and ``rho = pi_old / pi_sparse``, so k1 and k3 are
estimators of ``KL(pi_sparse || pi_old)`` (the direction the samples support without extra weighting; the
same quantity slime and verl log as their mismatch KL). ``KL(pi_old || pi_sparse)`` is estimated from the
same samples by importance weighting with rho: k1 ``E_sparse[rho log rho]`` and k3 ``E_sparse[1 - rho + rho log rho]``
(the k3 of the reversed ratio ``1/rho``, weighted by rho; never negative). Fractions over an empty set are 0; statistics of an
empty set (rho quantiles, ESS, log-ppl) are NaN. These are logs, never the loss.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from sparse_rl_megatron.algo.validation import as_bool_mask
from sparse_rl_megatron.observability import metric_names as MN


def masked_quantiles(values: torch.Tensor, mask: torch.Tensor, qs: Sequence[float]) -> list[float]:
    """Quantiles of ``values[mask]`` with linear interpolation (numpy's default); NaN if the mask is empty.

    Sort-based, so it has no input-size limit (``torch.quantile`` refuses > 2^24 elements).
    """
    selected = values[as_bool_mask(mask)].to(torch.float64)
    n = selected.numel()
    if n == 0:
        return [math.nan for _ in qs]
    ordered = torch.sort(selected).values
    out = []
    for q in qs:
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        frac = pos - lo
        out.append(float(ordered[lo] + (ordered[hi] - ordered[lo]) * frac))
    return out


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """ESS fraction ``(sum w)^2 / (N * sum w^2)`` in (0, 1] over ``mask``; scale-invariant; NaN if empty."""
    w = weights[as_bool_mask(mask)].to(torch.float64)
    if w.numel() == 0 or float(w.square().sum()) == 0.0:
        return math.nan
    return float(w.sum().square() / (w.numel() * w.square().sum()))


def _frac(num: torch.Tensor, den: torch.Tensor) -> float:
    den = float(den)
    return float(num) / den if den > 0 else 0.0


def _mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    if n == 0:
        return math.nan
    return float(torch.where(mask, values.to(torch.float64), torch.zeros((), dtype=torch.float64)).sum() / n)


def mismatch_metrics(
    *,
    log_rho: torch.Tensor,
    old_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    vetoed: torch.Tensor,
    weights: torch.Tensor,
    weight_norm_factor: float,
    ratio_lower: float,
    ratio_upper: float,
    weight_upper: float,
) -> dict[str, float]:
    """All ``sparse/*`` metrics of the table above.

    Args:
        log_rho: ``[B, T]`` clamped log rho; old_log_probs / sampler_log_probs: ``[B, T]``.
        response_mask: ``[B, T]`` the ORIGINAL response mask; loss_mask: ``[B, T]`` the final one.
        vetoed: ``[B]`` bool sequence-veto flags; weights: ``[B, T]`` raw weights (0 off the loss mask).
        weight_norm_factor: the global normalisation factor applied to the weights.
        ratio_lower, ratio_upper: token rejection bounds on rho; weight_upper: the weight cap.
    """
    response_mask = as_bool_mask(response_mask, "response_mask")
    loss_mask = as_bool_mask(loss_mask, "loss_mask")
    rho = torch.exp(log_rho.to(torch.float64))
    n_tok = response_mask.sum()
    has_tokens = response_mask.any(dim=-1)
    n_seq = has_tokens.sum()
    kept_seq = loss_mask.any(dim=-1)
    rho_min = float(torch.where(response_mask, rho, torch.full_like(rho, math.inf)).min()) if int(n_tok) else math.nan
    rho_max = float(torch.where(response_mask, rho, torch.full_like(rho, -math.inf)).max()) if int(n_tok) else math.nan
    p1, p5, p50 = masked_quantiles(rho, response_mask, (0.01, 0.05, 0.5))
    log_ppl_old = -_mean(old_log_probs, response_mask)
    log_ppl_sparse = -_mean(sampler_log_probs, response_mask)
    lr = log_rho.to(torch.float64)
    return {
        MN.SPARSE_NUM_SEQS: float(n_seq),
        MN.SPARSE_REJECTED_SEQ_FRAC: _frac((has_tokens & ~kept_seq).sum(), n_seq),
        MN.SPARSE_VETOED_SEQ_FRAC: _frac((has_tokens & vetoed).sum(), n_seq),
        MN.SPARSE_REJECTED_TOKEN_FRAC: _frac((response_mask & ~loss_mask).sum(), n_tok),
        MN.SPARSE_TOKEN_BELOW_FRAC: _frac((response_mask & (rho < ratio_lower)).sum(), n_tok),
        MN.SPARSE_TOKEN_ABOVE_FRAC: _frac((response_mask & (rho > ratio_upper)).sum(), n_tok),
        MN.SPARSE_TRUNCATED_FRAC: _frac((response_mask & (rho > weight_upper)).sum(), n_tok),
        MN.SPARSE_RHO_MEAN: _mean(rho, response_mask),
        MN.SPARSE_RHO_MIN: rho_min,
        MN.SPARSE_RHO_MAX: rho_max,
        MN.SPARSE_RHO_P1: p1,
        MN.SPARSE_RHO_P5: p5,
        MN.SPARSE_RHO_P50: p50,
        MN.SPARSE_KL_K1: _mean(-lr, response_mask),
        MN.SPARSE_KL_K3: _mean(torch.expm1(lr) - lr, response_mask),
        MN.SPARSE_KL_OLD_SPARSE_K1: _mean(rho * lr, response_mask),
        MN.SPARSE_KL_OLD_SPARSE_K3: _mean(-torch.expm1(lr) + rho * lr, response_mask),
        MN.SPARSE_LOG_PPL_OLD: log_ppl_old,
        MN.SPARSE_LOG_PPL_SPARSE: log_ppl_sparse,
        MN.SPARSE_LOG_PPL_DIFF: log_ppl_old - log_ppl_sparse,
        MN.SPARSE_WEIGHT_MEAN: _mean(weights, loss_mask),
        MN.SPARSE_WEIGHT_NORM_FACTOR: float(weight_norm_factor),
        MN.SPARSE_ESS: effective_sample_size(weights, loss_mask),
    }
