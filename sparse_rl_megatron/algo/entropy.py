"""Token entropy of the policy from logits, for the (optional) entropy bonus of the loss.

The Megatron learner computes entropy vocab-parallel itself and passes ``[B, T]`` entropies to
``loss.micro_batch_loss``; this function is the single-device reference used on CPU and in tests.
"""
from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) - sum softmax(z) * z`` over the last dim: ``[..., V] -> [...]`` (float32 or wider).

    Computed in at least float32 (bf16 softmax sums lose ~3 digits), differentiable.
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary dim [..., V], got shape {tuple(logits.shape)}")
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    log_z = torch.logsumexp(z, dim=-1)
    return log_z - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
