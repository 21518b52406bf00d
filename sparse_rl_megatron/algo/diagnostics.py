"""Rollout diagnostics logged in EVERY correction mode: what the veto would do, whom it hits, and the entropy.

``correction.mode: none`` (naive sparse rollouts) rejects nothing, so ``sparse/vetoed_seq_frac`` is 0 there by
construction and a growing mismatch would stay invisible. These metrics evaluate the veto check whatever the
mode, on the unmodified response masks (keys, all floats):

==========================================  =================================================================
``sparse/would_veto_frac``                  samples (with >= 1 response token) having some rho_t < threshold
``sparse/contaminated_frac``                 samples (with >= 1 response token) having some rho_t < 0.5
                                            (``CONTAMINATION_THRESHOLD``; the adaptive budget's default signal)
``sparse/reward_mean_would_veto``           mean reward of those samples (NaN if none)
``sparse/reward_mean_would_keep``           mean reward of the others (NaN if none)
``sparse/reward_mean_kept``                 mean reward of the samples that train (keep, after the correction)
``sparse/reward_mean_rejected``             mean reward of the samples the correction dropped whole (NaN if none)
``sparse/would_veto_frac/len_<lo>_<hi>``    ``would_veto_frac`` among samples with lo <= response tokens < hi
``sparse/seq_frac/len_<lo>_<hi>``           share of the samples in that length bin (non-empty bins only)
``sparse/entropy_sampler``                  token-mean ``-log pi_sparse(y_t)``: the sampler's per-token entropy
``sparse/entropy_dense``                    ``sum rho_t (-log pi_old(y_t)) / sum rho_t``: pi_old's entropy at the
                                            same prefixes, by self-normalised importance weighting
==========================================  =================================================================

The two entropies are estimates of the T = 1 policies' entropies only when the rollouts were sampled at
temperature 1 with top_p 1 (tokens drawn from pi_sparse, so E[-log pi_sparse(y)] = H(pi_sparse), and
E[rho (-log pi_old(y))] = H(pi_old) per prefix); otherwise they are the samples' mean negative log-probs. With
dense rollouts rho = 1 and the two coincide. Length bins are fixed (``LENGTH_BIN_EDGES``, powers of two from
32), so runs with different lengths share keys. Torch only.
"""
from __future__ import annotations

import math

import torch

from sparse_rl_megatron.algo.rejection import sequence_veto
from sparse_rl_megatron.algo.validation import as_bool_mask, check_2d, check_per_sample, check_same_shape
from sparse_rl_megatron.observability import metric_names as MN

WOULD_VETO_THRESHOLD = 1e-4
"""The veto threshold checked when the correction has none (``veto_threshold`` None or 0): the reference's."""
CONTAMINATION_THRESHOLD = 0.5
"""A sample is "contaminated" when some response token has rho < this (issue 27's audit: the share of such samples
tracks the budget and the reward gap far better than the veto rate does)."""
LENGTH_BIN_EDGES = (0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Response-length bins [edge_i, edge_i+1); the last bin is open (``len_32768_inf``)."""


def length_bin(length: int) -> str:
    """The key suffix of the bin holding ``length`` response tokens: 66 -> ``len_64_128``."""
    if length < 0:
        raise ValueError(f"a response length is >= 0, got {length}")
    for lo, hi in zip(LENGTH_BIN_EDGES, LENGTH_BIN_EDGES[1:]):
        if lo <= length < hi:
            return f"len_{lo}_{hi}"
    return f"len_{LENGTH_BIN_EDGES[-1]}_inf"


def _mean_where(values: torch.Tensor, select: torch.Tensor) -> float:
    n = int(select.sum())
    return float(values[select].to(torch.float64).sum() / n) if n else math.nan


def would_veto(log_rho: torch.Tensor, response_mask: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """``[B]`` bool: some response token has ``rho_t < threshold`` (None / 0: ``WOULD_VETO_THRESHOLD``): the
    sequence veto's own check (``rejection.sequence_veto``), whatever the correction mode does with it."""
    return sequence_veto(log_rho, response_mask, threshold or WOULD_VETO_THRESHOLD)


def rollout_diagnostics(*, log_rho: torch.Tensor, old_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor,
                        response_mask: torch.Tensor, keep: torch.Tensor, rewards: torch.Tensor,
                        veto_threshold: float | None) -> dict[str, float]:
    """The metrics of the module docstring for one rollout batch.

    Args:
        log_rho: ``[B, T]`` clamped ``log pi_old - log pi_sparse`` (0 at padding).
        old_log_probs, sampler_log_probs: ``[B, T]`` dense old and sampler log-probs of the sampled tokens
            (only read at response tokens; padding may hold anything).
        response_mask: ``[B, T]`` the ORIGINAL response mask (bool or 0/1).
        keep: ``[B]`` bool, the sample trains after the correction (``PreparedBatch.keep``).
        rewards: ``[B]`` outcome rewards.
        veto_threshold: the correction's veto threshold (None / 0: ``WOULD_VETO_THRESHOLD``).
    """
    check_2d(log_rho, "log_rho")
    check_same_shape("log_rho", log_rho, old_log_probs=old_log_probs, sampler_log_probs=sampler_log_probs,
                     response_mask=response_mask)
    batch = log_rho.shape[0]
    check_per_sample(rewards, "rewards", batch)
    check_per_sample(keep, "keep", batch)
    mask = as_bool_mask(response_mask, "response_mask")
    keep = keep.to(torch.bool)
    has = mask.any(dim=-1)  # [B]
    veto = would_veto(log_rho, mask, veto_threshold) & has
    contaminated = sequence_veto(log_rho, mask, CONTAMINATION_THRESHOLD) & has
    rewards = rewards.to(torch.float64)
    n_seq = int(has.sum())
    out = {
        MN.SPARSE_WOULD_VETO_FRAC: int(veto.sum()) / n_seq if n_seq else 0.0,
        MN.SPARSE_CONTAMINATED_FRAC: int(contaminated.sum()) / n_seq if n_seq else 0.0,
        MN.SPARSE_REWARD_MEAN_WOULD_VETO: _mean_where(rewards, veto),
        MN.SPARSE_REWARD_MEAN_WOULD_KEEP: _mean_where(rewards, has & ~veto),
        MN.SPARSE_REWARD_MEAN_KEPT: _mean_where(rewards, has & keep),
        MN.SPARSE_REWARD_MEAN_REJECTED: _mean_where(rewards, has & ~keep),
    }
    lengths = mask.sum(dim=-1).tolist()
    bins: dict[str, list[int]] = {}
    for i, (n, h) in enumerate(zip(lengths, has.tolist())):
        if h:
            bins.setdefault(length_bin(int(n)), []).append(i)
    for name, rows in sorted(bins.items(), key=lambda kv: int(kv[0].split("_")[1])):
        idx = torch.tensor(rows, dtype=torch.long)
        out[f"sparse/would_veto_frac/{name}"] = float(veto[idx].to(torch.float64).mean())
        out[f"sparse/seq_frac/{name}"] = len(rows) / n_seq
    zero = torch.zeros((), dtype=torch.float64)
    nll_sparse = torch.where(mask, -sampler_log_probs.to(torch.float64), zero)
    nll_old = torch.where(mask, -old_log_probs.to(torch.float64), zero)
    rho = torch.where(mask, torch.exp(log_rho.to(torch.float64)), zero)
    n_tok = int(mask.sum())
    out[MN.SPARSE_ENTROPY_SAMPLER] = float(nll_sparse.sum() / n_tok) if n_tok else math.nan
    weight = float(rho.sum())
    out[MN.SPARSE_ENTROPY_DENSE] = float((rho * nll_old).sum()) / weight if n_tok and weight > 0 else math.nan
    return out
