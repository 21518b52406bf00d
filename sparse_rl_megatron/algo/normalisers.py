"""The global counts every micro-batch loss needs, gathered once over the whole global batch.

``local_normalisers`` computes a micro-batch's (or a rank's) part; parts add up (``+``, or all-reduce SUM of
``as_tensor()``). ``prepare_correction`` returns the global value directly because it sees the global
rollout batch; a learner that only holds a shard sums the parts itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_rl_megatron.algo.reductions import SEQUENCES, TOKENS, count_units
from sparse_rl_megatron.algo.reweighting import weight_stats
from sparse_rl_megatron.algo.validation import as_bool_mask, check_same_shape


@dataclass(frozen=True)
class GlobalNormalisers:
    """Sums over the whole global batch (all micro-batches and data-parallel ranks)."""

    weight_sum: float
    """Sum of the raw importance weights over the kept tokens (for the mean-1 normalisation)."""
    kept_tokens: float
    """Tokens that train (post-rejection mask): the ``token_mean`` denominator and the weight count."""
    kept_seqs: float
    """Sequences with at least one kept token: the denominator of the per-sequence reductions."""
    response_tokens: float
    """Response tokens before rejection: the denominator of metrics on the unmodified masks."""

    def weight_stats(self) -> torch.Tensor:
        """``[sum, count]`` float64, the argument of ``reweighting.normalise_weights``."""
        return torch.tensor([self.weight_sum, self.kept_tokens], dtype=torch.float64)

    def denominator(self, unit: str) -> float:
        """The global count of ``unit`` (``"tokens"`` or ``"sequences"``) of the post-rejection mask."""
        if unit == TOKENS:
            return self.kept_tokens
        if unit == SEQUENCES:
            return self.kept_seqs
        raise ValueError(f"unit must be '{TOKENS}' or '{SEQUENCES}', got '{unit}'")

    def as_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """float64 ``[4]`` for an all-reduce(SUM)."""
        return torch.tensor(
            [self.weight_sum, self.kept_tokens, self.kept_seqs, self.response_tokens], dtype=torch.float64, device=device
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "GlobalNormalisers":
        if t.shape != (4,):
            raise ValueError(f"expected a [4] tensor from GlobalNormalisers.as_tensor, got shape {tuple(t.shape)}")
        return cls(*(float(v) for v in t.tolist()))

    def __add__(self, other: "GlobalNormalisers") -> "GlobalNormalisers":
        return GlobalNormalisers.from_tensor(self.as_tensor() + other.as_tensor())


def local_normalisers(loss_mask: torch.Tensor, response_mask: torch.Tensor, weights: torch.Tensor) -> GlobalNormalisers:
    """This part's contribution (``[B, T]`` post-rejection mask, original mask, raw weights)."""
    check_same_shape("loss_mask", loss_mask, response_mask=response_mask, weights=weights)
    loss_mask = as_bool_mask(loss_mask, "loss_mask")
    stats = weight_stats(weights, loss_mask)
    return GlobalNormalisers(
        weight_sum=float(stats[0]),
        kept_tokens=float(stats[1]),
        kept_seqs=float(count_units(loss_mask, SEQUENCES)),
        response_tokens=float(as_bool_mask(response_mask, "response_mask").sum()),
    )
