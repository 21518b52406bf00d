"""What a budget study compares and what it reports per row.

Rows: ``dense`` first (compression off: the engine's own consistency check, |log rho| ~ 0), then the run's
compressor at each budget, every other compression field as in the recipe. Rejections are counted with the run's
``correction`` section; a mode that rejects nothing (``none``, ``reweight_only``) is measured as ``sparse_rl``
with the same bounds, since the question is what Sparse-RL's rejection would drop.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from sparse_rl_megatron.algo.modes import CORRECTION_MODES
from sparse_rl_megatron.algo.rho_stats import rho_summary
from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.observability import metric_names as MN

if TYPE_CHECKING:
    from sparse_rl_megatron.algo import CorrectionConfig
    from sparse_rl_megatron.trainer.step import RolloutBatch

DENSE_LABEL = "dense"
REJECTING_MODE = "sparse_rl"
"""The correction mode used to count rejections when the run's own mode rejects nothing."""


@dataclass
class RowResult:
    """One row of the study: a compression setting and what sampling with it did."""

    label: str
    """``dense`` or ``<method> B=<budget>``."""
    compression: CompressionConfig
    """The engine's KV compression for this row."""
    stats: dict[str, float]
    """``rollout/*``, ``sparse/*``, ``time/*`` of the trainer's step functions, ``rho/*`` and ``log_rho/*`` of
    ``algo.rho_stats.rho_summary``, and ``rollout/kv_tokens_peak_max``."""
    log_rho: torch.Tensor
    """``[N]`` float32 log rho of every response token of the row (the histogram's input)."""
    samples: list[dict[str, Any]]
    """Per sample: group, index, problem id, reward, length, finish reason, compression events, peak KV, and the
    sum of log rho and the smallest rho over its response."""


def study_rows(compression: CompressionConfig, budgets: Sequence[int]) -> list[tuple[str, CompressionConfig]]:
    """``(label, compression)`` of every row: dense, then ``compression`` at each budget (raises ``ValueError``
    from ``CompressionConfig`` for a budget that does not fit the other fields, e.g. not above the window)."""
    rows = [(DENSE_LABEL, CompressionConfig())]
    for budget in budgets:
        rows.append((f"{compression.method} B={budget}", dataclasses.replace(compression, budget=budget)))
    return rows


def rejecting_correction(correction: "CorrectionConfig") -> tuple["CorrectionConfig", str | None]:
    """The correction the study counts rejections with, and a note when it is not the run's own."""
    mode = CORRECTION_MODES.get(correction.mode)
    if mode.rejects or mode.uses_hook:
        return correction, None
    note = (f"correction.mode '{correction.mode}' rejects nothing; the rejection columns show what mode "
            f"'{REJECTING_MODE}' would reject with the same bounds (veto rho < {correction.veto_threshold}, tokens "
            f"outside [{correction.rejection_lower}, {correction.rejection_upper}])")
    return dataclasses.replace(correction, mode=REJECTING_MODE), note


def row_result(label: str, compression: CompressionConfig, batch: "RolloutBatch") -> RowResult:
    """The statistics of one row from the batch ``trainer.step.rollout_step`` returned for it."""
    prepared = batch.prepared
    mask, log_rho = prepared.response_mask, prepared.log_rho  # [B, T]
    stats = {**batch.metrics, **rho_summary(log_rho, mask)}
    stats[MN.ROLLOUT_KV_TOKENS_PEAK_MAX] = float(max(s.compression.peak_kv_tokens for s in batch.samples))
    seq_sum = torch.where(mask, log_rho, torch.zeros_like(log_rho)).sum(dim=-1)  # [B]
    seq_min = torch.where(mask, log_rho, torch.full_like(log_rho, float("inf"))).min(dim=-1).values  # [B]
    samples = []
    for i, s in enumerate(batch.samples):
        has_tokens = bool(mask[i].any())
        samples.append({
            "group": s.group_id, "index": s.index_in_group, "source_id": s.metadata.get("source_id"),
            "reward": s.reward, "response_tokens": s.response_length, "finish_reason": s.finish_reason,
            "compression_events": s.compression.events, "peak_kv_tokens": s.compression.peak_kv_tokens,
            "log_rho_sum": float(seq_sum[i]),
            "rho_min": float(torch.exp(seq_min[i])) if has_tokens else None, "kept": bool(prepared.keep[i])})
    return RowResult(label, compression, stats, log_rho[mask].float(), samples)
