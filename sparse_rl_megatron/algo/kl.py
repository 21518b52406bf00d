"""Per-token KL penalty estimators between the current policy and a reference policy (Schulman 2020,
"Approximating KL divergence", http://joschu.net/blog/kl-approx.html; names as in verl).

With ``d = log pi_theta(y_t) - log pi_ref(y_t)`` on tokens sampled from (approximately) pi_theta:

* ``k1``: ``d`` (unbiased for KL(pi_theta || pi_ref), high variance, can be negative).
* ``k2``: ``d^2 / 2`` (biased, low variance, >= 0).
* ``low_var_kl`` (alias ``k3``): ``exp(-d) - 1 + d``, clamped to ``[-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP]``
  (unbiased, >= 0, low variance). Used by the reference runs with coefficient 1e-4.
"""
from __future__ import annotations

from typing import Callable

import torch

from sparse_rl_megatron.algo.ratio import LOG_RATIO_CLAMP
from sparse_rl_megatron.algo.validation import as_bool_mask, check_2d, check_same_shape
from sparse_rl_megatron.utils.registry import Registry

LOW_VAR_KL_CLAMP = 10.0
"""The k3 estimate is clamped to +-10 (as verl's ``low_var_kl``): one token with a huge log-ratio would
otherwise dominate the penalty of the whole batch; 10 nats per token is already an extreme divergence."""

KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


@KL_ESTIMATORS.register("k2")
def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def _low_var_kl(d: torch.Tensor) -> torch.Tensor:
    log_r = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log(pi_ref / pi_theta), clamped before exp
    return (torch.expm1(log_r) - log_r).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


KL_ESTIMATORS.add("low_var_kl", _low_var_kl)
KL_ESTIMATORS.add("k3", _low_var_kl)


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: str = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]``, exactly 0 (with zero gradient) outside ``mask``.

    Args:
        log_probs: ``[B, T]`` log pi_theta(y_t) (carries the gradient).
        ref_log_probs: ``[B, T]`` log pi_ref(y_t) of the frozen reference policy.
        mask: ``[B, T]`` bool or 0/1.
        estimator: ``k1`` | ``k2`` | ``low_var_kl`` (= ``k3``).
    """
    fn = KL_ESTIMATORS.get(estimator)
    check_2d(log_probs, "log_probs")
    check_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs, mask=mask)
    mask = as_bool_mask(mask)
    d = torch.where(mask, log_probs - ref_log_probs.detach(), torch.zeros_like(log_probs))
    out = fn(d)
    return torch.where(mask, out, torch.zeros_like(out))
