"""The distribution of rho = pi_old / pi_sparse over a batch, for choosing a KV budget before training.

Training logs a few rho statistics per step (``metrics.mismatch_metrics``); a budget study needs the whole
lower tail, where the damage of a compressed cache hides (the median and p5 of rho sit at ~1 while p1 and the
minimum fall by orders of magnitude), plus the whole-sequence view (the sum of log rho over a response) and a
histogram of log rho that several batches share, so they can be drawn side by side.

``rho_summary``:

======================================  ======================================================================
``rho/min``, ``rho/max``, ``rho/mean``  over response tokens
``rho/p0.1|p1|p5|p50|p99``              linear-interpolated quantiles of rho (``RHO_QUANTILES``)
``log_rho/abs_mean|abs_max``            mean / largest ``|log rho|``: ~0 when sampler and learner agree (dense)
``log_rho/seq_sum_mean|seq_sum_min``    mean / lowest over sequences of ``sum_t log rho_t`` (a whole-response
                                        importance ratio in log space)
======================================  ======================================================================

Statistics of an empty set are NaN. Torch only.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from sparse_rl_megatron.algo.metrics import masked_quantiles
from sparse_rl_megatron.algo.validation import as_bool_mask, check_2d, check_same_shape
from sparse_rl_megatron.observability import metric_names as MN

RHO_QUANTILES: dict[str, float] = {"p0.1": 0.001, "p1": 0.01, "p5": 0.05, "p50": 0.5, "p99": 0.99}
"""Quantiles of rho a budget study reports, by name."""
SUMMARY_KEYS = (MN.RHO_MIN, *(f"rho/{name}" for name in RHO_QUANTILES), MN.RHO_MAX, MN.RHO_MEAN, MN.LOG_RHO_ABS_MEAN,
                MN.LOG_RHO_ABS_MAX, MN.LOG_RHO_SEQ_SUM_MEAN, MN.LOG_RHO_SEQ_SUM_MIN)
"""The keys of ``rho_summary``, in table order."""
MIN_HISTOGRAM_SPAN = 1e-6
"""Narrowest log-rho range a histogram spans: when every value is (nearly) equal, e.g. an exactly consistent
dense engine, the bins are centred on that value instead of having zero width."""


def rho_summary(log_rho: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The statistics of the module table.

    Args:
        log_rho: ``[B, T]`` (clamped) log rho per response token; mask: ``[B, T]`` bool or 0/1, real tokens.
    Returns:
        ``{name: float}`` (NaN for statistics of an empty mask).
    """
    check_2d(log_rho, "log_rho")
    check_same_shape("log_rho", log_rho, mask=mask)
    mask = as_bool_mask(mask, "mask")
    lr = log_rho.detach().to(torch.float64)
    values = lr[mask]
    if values.numel() == 0:
        return {key: math.nan for key in SUMMARY_KEYS}
    rho = torch.exp(values)
    out = {MN.RHO_MIN: float(rho.min())}
    quantiles = masked_quantiles(torch.exp(lr), mask, list(RHO_QUANTILES.values()))
    out.update({f"rho/{name}": value for name, value in zip(RHO_QUANTILES, quantiles)})
    out[MN.RHO_MAX] = float(rho.max())
    out[MN.RHO_MEAN] = float(rho.mean())
    out[MN.LOG_RHO_ABS_MEAN] = float(values.abs().mean())
    out[MN.LOG_RHO_ABS_MAX] = float(values.abs().max())
    has_tokens = mask.any(dim=-1)
    seq_sums = torch.where(mask, lr, torch.zeros_like(lr)).sum(dim=-1)[has_tokens]
    out[MN.LOG_RHO_SEQ_SUM_MEAN] = float(seq_sums.mean())
    out[MN.LOG_RHO_SEQ_SUM_MIN] = float(seq_sums.min())
    return out


def histogram_edges(values: Sequence[torch.Tensor], bins: int) -> torch.Tensor:
    """``[bins + 1]`` float64 edges spanning every value of every tensor in ``values`` (equal widths), at least
    ``MIN_HISTOGRAM_SPAN`` wide; ``[-span/2, span/2]`` when there is no value at all."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    flat = [v.detach().reshape(-1).to(torch.float64) for v in values if v.numel()]
    if flat:
        lo = min(float(v.min()) for v in flat)
        hi = max(float(v.max()) for v in flat)
    else:
        lo = hi = 0.0
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"histogram values must be finite, got range [{lo}, {hi}]")
    if hi - lo < MIN_HISTOGRAM_SPAN:
        mid = (lo + hi) / 2
        lo, hi = mid - MIN_HISTOGRAM_SPAN / 2, mid + MIN_HISTOGRAM_SPAN / 2
    return torch.linspace(lo, hi, bins + 1, dtype=torch.float64)


def histogram_counts(values: torch.Tensor, edges: torch.Tensor) -> list[int]:
    """Counts of ``values`` (any shape) in the bins ``[e_i, e_i+1)`` of ``edges`` (the last bin also holds its
    right edge); values outside ``[edges[0], edges[-1]]`` are not counted."""
    v = values.detach().reshape(-1).to(torch.float64)
    inside = v[(v >= edges[0]) & (v <= edges[-1])]
    index = torch.bucketize(inside, edges, right=True) - 1  # e_i <= v < e_i+1  ->  i
    index = index.clamp(max=edges.numel() - 2)  # v == edges[-1] -> the last bin
    return torch.bincount(index, minlength=edges.numel() - 1).tolist()
