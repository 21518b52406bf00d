"""PPO-clip policy loss per token (Schulman et al. 2017; asymmetric eps as in DAPO, arXiv 2503.14476).

``r_t = pi_theta(y_t) / pi_old(y_t)``: CURRENT log-probs over the DENSE OLD log-probs (never the sampler's:
the sampler/old gap is the sparsity ratio of ``ratio.py``, handled by rejection and reweighting)::

    loss_t = max(-r_t * A, -clip(r_t, 1 - eps_low, 1 + eps_high) * A) * w_t

with ``w_t`` the (normalised, detached) Sparse-RL importance weight.
"""
from __future__ import annotations

import torch

from sparse_rl_megatron.algo.ratio import LOG_RATIO_CLAMP
from sparse_rl_megatron.algo.validation import as_bool_mask, check_2d, check_same_shape


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss (not reduced).

    Args:
        log_probs: ``[B, T]`` log pi_theta(y_t), carries the gradient.
        old_log_probs: ``[B, T]`` log pi_old(y_t) (dense recompute before the first update of the rollout).
        advantages: ``[B]`` per-sample or ``[B, T]`` per-token advantages.
        mask: ``[B, T]`` bool or 0/1: tokens that train. Elsewhere loss and gradient are exactly 0.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (both >= 0, eps_low < 1).
        weights: optional ``[B, T]`` importance weights, applied detached.

    Returns:
        ``(loss [B, T], clipped [B, T] bool)``; ``clipped`` marks masked tokens where the clipped branch is
        the larger (active) one, i.e. the PPO clip fraction numerator.
    """
    check_2d(log_probs, "log_probs")
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, mask=mask, weights=weights)
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    mask = as_bool_mask(mask)
    if advantages.dim() == 1:
        if advantages.shape[0] != log_probs.shape[0]:
            raise ValueError(f"advantages [B] has B={advantages.shape[0]}, log_probs has B={log_probs.shape[0]}")
        advantages = advantages.unsqueeze(-1)
    else:
        check_same_shape("log_probs", log_probs, advantages=advantages)
    advantages = advantages.detach().to(log_probs.dtype).expand_as(log_probs)
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    # Select padding away BEFORE exp: exp(garbage) = inf there would turn the zero gradient of the
    # unselected branch into 0 * inf = NaN during backward.
    log_ratio = torch.where(mask, log_probs - old_log_probs.detach(), torch.zeros_like(log_probs))
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -ratio * advantages
    clipped_term = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped_term)
    if weights is not None:
        loss = loss * torch.where(mask, weights.detach(), torch.zeros_like(weights)).to(loss.dtype)
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    clipped = mask & (clipped_term > unclipped)
    return loss, clipped
