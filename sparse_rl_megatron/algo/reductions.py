"""Loss reductions by name, each with a GLOBAL denominator so micro-batch splits give the same gradient.

Notation: ``m_it`` the post-rejection loss mask, ``x_it`` the per-token loss, ``n_i = sum_t m_it``, and the
global counts over the WHOLE global batch (all micro-batches, all data-parallel ranks):
``N_tok = sum_i n_i`` (kept tokens) and ``N_seq = #{i : n_i > 0}`` (kept sequences).

* ``seq_mean_token_mean`` (reference runs): ``sum_i [sum_t m_it x_it / n_i] / N_seq``: mean over the kept
  tokens of each sequence, summed over sequences, scaled to the global batch.
* ``token_mean``: ``sum_it m_it x_it / N_tok``.
* ``seq_mean_token_sum``: ``sum_it m_it x_it / N_seq``.

Denominator rule: rejected tokens and vetoed / fully rejected sequences are in NO denominator. (slime
divides by the global batch size including vetoed samples, which shrinks the step whenever samples are
vetoed; verl/slime fixed the token-level version of this in PR #3915 / #657.) An empty global batch
(denominator 0) gives loss exactly 0 with zero gradient, never 0/0.

A reduction applied to one micro-batch returns that micro-batch's SHARE of the global value: summing the
results over all micro-batches and ranks gives the global loss, so accumulating their gradients gives the
full-batch gradient exactly (up to float rounding of the sum order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sparse_rl_megatron.algo.validation import as_bool_mask, check_2d, check_same_shape
from sparse_rl_megatron.utils.registry import Registry

TOKENS = "tokens"
SEQUENCES = "sequences"


@dataclass(frozen=True)
class Reduction:
    """A named loss reduction: the numerator on a micro-batch, and the unit of its global denominator."""

    numerator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``(values [B, T], mask [B, T] bool) -> scalar``: the micro-batch's un-normalised sum."""
    unit: str
    """What the global denominator counts: ``"tokens"`` (N_tok) or ``"sequences"`` (N_seq)."""


REDUCTIONS: Registry[Reduction] = Registry("loss reduction")


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values))


def _seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_seq = _masked(values, mask).sum(dim=-1) / mask.sum(dim=-1).clamp_min(1).to(values.dtype)
    return per_seq.sum()


def _token_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked(values, mask).sum()


REDUCTIONS.add("seq_mean_token_mean", Reduction(_seq_mean_token_mean, SEQUENCES))
REDUCTIONS.add("token_mean", Reduction(_token_sum, TOKENS))
REDUCTIONS.add("seq_mean_token_sum", Reduction(_token_sum, SEQUENCES))


def count_units(mask: torch.Tensor, unit: str) -> torch.Tensor:
    """Local count of ``unit`` in ``mask`` (float64 scalar): kept tokens, or sequences with a kept token."""
    mask = as_bool_mask(mask)
    if unit == TOKENS:
        return mask.sum().to(torch.float64)
    if unit == SEQUENCES:
        return mask.any(dim=-1).sum().to(torch.float64)
    raise ValueError(f"unit must be '{TOKENS}' or '{SEQUENCES}', got '{unit}'")


def local_denominator(name: str, mask: torch.Tensor) -> torch.Tensor:
    """The micro-batch's part of reduction ``name``'s global denominator; sum it over the global batch."""
    return count_units(mask, REDUCTIONS.get(name).unit)


def reduce_loss(
    name: str, values: torch.Tensor, mask: torch.Tensor, global_denominator: float | torch.Tensor
) -> torch.Tensor:
    """This micro-batch's share of the global reduced loss (scalar, dtype of ``values``).

    Args:
        name: ``seq_mean_token_mean`` | ``token_mean`` | ``seq_mean_token_sum``.
        values: ``[B, T]`` per-token loss of the micro-batch.
        mask: ``[B, T]`` bool or 0/1 post-rejection loss mask of the micro-batch.
        global_denominator: the sum of ``local_denominator(name, mask)`` over the whole global batch.
    """
    reduction = REDUCTIONS.get(name)
    check_2d(values, "values")
    check_same_shape("values", values, mask=mask)
    mask = as_bool_mask(mask)
    denom = float(global_denominator)
    if not (denom >= 0 and denom != float("inf")):
        raise ValueError(f"global_denominator must be a finite number >= 0, got {global_denominator}")
    # denominator 0 only happens when no token is kept anywhere: the numerator is then an exact 0 too
    return reduction.numerator(values, mask) / max(denom, 1.0)
