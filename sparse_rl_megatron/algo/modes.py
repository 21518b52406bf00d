"""Correction modes: what the loss mask and the raw weights of a rollout batch become, chosen by
``CorrectionConfig.mode``.

A mode is a function ``(CorrectionInputs, CorrectionConfig) -> Correction`` registered under its name with
``@register_correction_mode(name, ...)``, which also declares what the mode needs and does (``CorrectionMode``);
a name registered twice is refused, an unknown one raises listing the valid names. ``prepare_correction`` and the
slime hook call the registered function; nothing else picks behaviour by a mode's name.

A new mode: a function of this signature in its own module (torch only), registered with the decorator, imported by
``algo/__init__.py`` (or by a run's ``plugins``) so that it registers before a config names it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from sparse_rl_megatron.algo.hooks import load_hook, run_hook_on_batch
from sparse_rl_megatron.algo.rejection import RejectionResult, reject
from sparse_rl_megatron.algo.reweighting import importance_weights
from sparse_rl_megatron.utils.registry import Registry


class CorrectionSettings(Protocol):
    """What a mode reads of its config (``config.CorrectionConfig`` is one; a protocol, so that this module and
    the config, which lists the registered modes, do not import each other)."""

    veto_threshold: float | None
    rejection_level: str
    rejection_key: str
    rejection_lower: float
    rejection_upper: float
    rejection_max_divergence: float | None
    weight_mode: str
    weight_lower: float
    weight_upper: float
    hook: str | None
    hook_args: Mapping[str, Any]


@dataclass(frozen=True)
class CorrectionInputs:
    """What a correction mode may read of a rollout batch (``[B, T]``, response-aligned)."""

    log_rho: torch.Tensor
    """Clamped log(pi_old / pi_sparse), 0 at padding (all 0 without sampler log-probs)."""
    response_mask: torch.Tensor
    """bool, the real response tokens."""
    old_log_probs: torch.Tensor
    """Dense old log-probs, 0 at padding."""
    sampler_log_probs: torch.Tensor | None = None
    """The sampler's log-probs (None only for a mode that does not need them)."""


@dataclass
class Correction:
    """What a correction mode returns."""

    loss_mask: torch.Tensor
    """``[B, T]`` bool, the tokens that train."""
    vetoed: torch.Tensor
    """``[B]`` bool, samples dropped whole."""
    weights: torch.Tensor
    """``[B, T]`` raw weights, 0 off ``loss_mask``, not yet normalised."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra rollout metrics of the mode (``hook/*`` for ``custom``)."""


CorrectionFn = Callable[[CorrectionInputs, CorrectionSettings], Correction]


@dataclass(frozen=True)
class CorrectionMode:
    """A registered correction mode: its function and what it declares."""

    name: str
    fn: CorrectionFn
    needs_sampler: bool = True
    """Needs the sampler's log-probs (a mode that does not only logs them when given)."""
    rejects: bool = False
    """Drops tokens and sequences by rho with the config's rejection bounds (what a budget study counts)."""
    uses_hook: bool = False
    """Runs the function at ``CorrectionConfig.hook`` (which it then requires; refused inside the slime hook)."""

    def __call__(self, inputs: CorrectionInputs, config: CorrectionSettings) -> Correction:
        return self.fn(inputs, config)


CORRECTION_MODES: Registry[CorrectionMode] = Registry("correction mode")


def register_correction_mode(name: str, *, needs_sampler: bool = True, rejects: bool = False,
                             uses_hook: bool = False) -> Callable[[CorrectionFn], CorrectionFn]:
    """Register the decorated function as correction mode ``name`` (a second registration of a name is refused)."""

    def decorator(fn: CorrectionFn) -> CorrectionFn:
        CORRECTION_MODES.add(name, CorrectionMode(name, fn, needs_sampler=needs_sampler, rejects=rejects,
                                                  uses_hook=uses_hook))
        return fn

    return decorator


def hook_modes() -> list[str]:
    """The registered modes that run ``CorrectionConfig.hook``."""
    return [n for n in CORRECTION_MODES.names() if CORRECTION_MODES.get(n).uses_hook]


def _rejection(inputs: CorrectionInputs, config: CorrectionSettings) -> RejectionResult:
    return reject(
        inputs.log_rho, inputs.response_mask, level=config.rejection_level, key=config.rejection_key,
        lower=config.rejection_lower, upper=config.rejection_upper,
        max_divergence=config.rejection_max_divergence, veto_threshold=config.veto_threshold,
    )


def _reweighted(log_rho: torch.Tensor, mask: torch.Tensor, config: CorrectionSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, loss_mask)`` of ``reweighting.importance_weights`` with the config's weight mode and bounds."""
    return importance_weights(log_rho, mask, mode=config.weight_mode, lower=config.weight_lower,
                              upper=config.weight_upper)


def _no_veto(response_mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(response_mask.shape[0], dtype=torch.bool, device=response_mask.device)


@register_correction_mode("sparse_rl", rejects=True)
def reject_and_reweight(inputs: CorrectionInputs, config: CorrectionSettings) -> Correction:
    """Sparse-RL: sequence veto and bound rejection, then importance weights of the kept tokens."""
    rejected = _rejection(inputs, config)
    weights, loss_mask = _reweighted(inputs.log_rho, rejected.mask, config)
    return Correction(loss_mask, rejected.vetoed, weights)


@register_correction_mode("rejection_only", rejects=True)
def rejection_only(inputs: CorrectionInputs, config: CorrectionSettings) -> Correction:
    """Sequence veto and bound rejection; every kept token has weight 1."""
    rejected = _rejection(inputs, config)
    return Correction(rejected.mask, rejected.vetoed, rejected.mask.to(inputs.log_rho.dtype))


@register_correction_mode("reweight_only")
def reweight_only(inputs: CorrectionInputs, config: CorrectionSettings) -> Correction:
    """Importance weights on every response token (mode ``mask`` of the weights may still drop some)."""
    weights, loss_mask = _reweighted(inputs.log_rho, inputs.response_mask, config)
    return Correction(loss_mask, _no_veto(inputs.response_mask), weights)


@register_correction_mode("none", needs_sampler=False)
def uncorrected(inputs: CorrectionInputs, config: CorrectionSettings) -> Correction:
    """Plain GRPO: every response token trains with weight 1."""
    mask = inputs.response_mask
    return Correction(mask, _no_veto(mask), mask.to(inputs.log_rho.dtype))


@register_correction_mode("custom", uses_hook=True)
def custom_hook(inputs: CorrectionInputs, config: CorrectionSettings) -> Correction:
    """The slime-style hook at ``config.hook`` on the whole batch (``hooks.run_hook_on_batch``)."""
    response, old = inputs.response_mask, inputs.old_log_probs
    weights, loss_mask, metrics = run_hook_on_batch(
        load_hook(config.hook), dict(config.hook_args), old, torch.where(response, inputs.sampler_log_probs, old),
        response)
    # the hook does not say why: a sample it dropped whole counts as vetoed (what was dropped, whatever dropped it)
    vetoed = response.any(dim=-1) & ~loss_mask.any(dim=-1)
    return Correction(loss_mask, vetoed, weights, metrics)
