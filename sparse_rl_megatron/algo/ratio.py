"""Sparsity consistency ratio rho = pi_old / pi_sparse (Sparse-RL, Luo et al. 2026, arXiv 2601.10079).

Which log-probs go where (pinned by ``tests/unit/test_algo_ratio.py``):

* ``log rho_t = log pi_old(y_t) - log pi_sparse(y_t)``: the DENSE OLD policy (recomputed by the learner
  with full attention and pre-update weights) over the SAMPLER (rollout engine on a compressed KV cache).
  The current policy pi_theta never enters rho; using it there is a known bug (slime PR #179).
* The PPO ratio ``pi_theta / pi_old`` (current over dense old) lives in ``policy_loss.py``.
"""
from __future__ import annotations

import torch

from sparse_rl_megatron.algo.validation import as_bool_mask, check_2d, check_finite_where, check_same_shape

LOG_RATIO_CLAMP = 20.0
"""|log rho| is clamped to this before any ``exp``: exp(20) ~ 4.9e8 is far beyond every bound we use
(veto 1e-4, token bounds [0.5, 1.5]) yet finite in float16/bfloat16/float32, so one absurd token can never
overflow to inf and poison a sum. Same value as verl's and slime's ``SAFETY_BOUND``."""


def sparsity_log_ratio(
    old_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token ``log rho = clamp(old - sampler, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)``.

    Args:
        old_log_probs: ``[B, T]`` log pi_old(y_t) of the sampled tokens (dense recompute, old weights).
        sampler_log_probs: ``[B, T]`` log pi_sparse(y_t) as returned by the rollout engine.
        mask: ``[B, T]`` bool or 0/1, True on real response tokens.

    Returns:
        ``[B, T]`` log rho, exactly 0 at padding (mask False). Never requires grad (detached).

    Raises:
        ValueError: on shape mismatch or a NaN/inf log-prob at a masked position.
    """
    check_2d(old_log_probs, "old_log_probs")
    check_same_shape("old_log_probs", old_log_probs, sampler_log_probs=sampler_log_probs, mask=mask)
    mask = as_bool_mask(mask)
    check_finite_where(old_log_probs, mask, "old_log_probs")
    check_finite_where(sampler_log_probs, mask, "sampler_log_probs")
    diff = old_log_probs.detach() - sampler_log_probs.detach()
    # where (not multiply): padding may hold NaN/inf, and NaN * 0 is NaN.
    diff = torch.where(mask, diff, torch.zeros_like(diff))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
