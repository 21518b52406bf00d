"""How a rollout batch is corrected for the sparse sampler: ``CorrectionConfig`` (the modes: ``modes.py``).

Defaults are the Sparse-RL reference runs (arXiv 2601.10079 and its slime-based code): sequence veto at
rho < 1e-4, token rejection outside rho in [0.5, 1.5], truncated weights min(rho, 1.5) normalised to mean 1
(here over the GLOBAL batch), GRPO advantages.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from sparse_rl_megatron.algo.advantages import ADVANTAGE_ESTIMATORS
from sparse_rl_megatron.algo.modes import CORRECTION_MODES, hook_modes
from sparse_rl_megatron.algo.rejection import RATIO_KEY, REJECTION_KEYS, REJECTION_LEVELS
from sparse_rl_megatron.algo.reweighting import WEIGHT_MODES


@dataclass
class CorrectionConfig:
    """Sparsity correction of one rollout batch (rejection, reweighting, advantages)."""

    mode: str = "sparse_rl"
    """Correction mode, a name in ``modes.CORRECTION_MODES``: ``sparse_rl`` (rejection + reweighting, the
    default); each registered function's docstring says what it does."""
    veto_threshold: float | None = 1e-4
    """Drop a whole sequence if any of its tokens has rho < this (None or 0: no veto)."""
    rejection_level: str = "token"
    """Rejection statistic level: ``token``, ``sequence`` (masked sum), ``geometric`` (masked mean)."""
    rejection_key: str = "k1"
    """Rejection key: ``k1`` (-log rho, ratio bounds), ``k2`` ((log rho)^2/2) or ``k3`` (rho-1-log rho)."""
    rejection_lower: float = 0.5
    """Lower ratio bound (inclusive) for key k1; also the ``token_below`` metric threshold."""
    rejection_upper: float = 1.5
    """Upper ratio bound (inclusive) for key k1; also the ``token_above`` metric threshold."""
    rejection_max_divergence: float | None = None
    """Upper bound (inclusive) on the k2/k3 statistic; required when ``rejection_key`` is k2 or k3."""
    weight_mode: str = "truncate"
    """Reweighting mode: ``truncate`` (min(rho, upper)), ``mask`` (rho, 0 and dropped outside bounds),
    ``clip`` (clamp(rho, lower, upper))."""
    weight_lower: float = 0.5
    """Lower weight bound for modes ``mask`` and ``clip``."""
    weight_upper: float = 1.5
    """Upper weight bound (truncation cap)."""
    normalise_weights: bool = True
    """Scale the weights to mean 1 over the kept tokens of the GLOBAL batch."""
    advantage_estimator: str = "grpo"
    """Advantage estimator: ``grpo``, ``drgrpo``, ``rloo``, ``reinforce`` (over kept samples only)."""
    advantage_eps: float = 1e-6
    """Added to the group std by ``grpo``."""
    hook: str | None = None
    """Dotted path ``package.module.function`` of a slime-style correction hook (only for a mode that runs one:
    ``custom``)."""
    hook_args: dict[str, Any] = field(default_factory=dict)
    """Options handed to the hook as attributes of its ``args`` argument."""

    def __post_init__(self) -> None:
        CORRECTION_MODES.check(self.mode, "CorrectionConfig.mode")
        REJECTION_LEVELS.check(self.rejection_level, "CorrectionConfig.rejection_level")
        REJECTION_KEYS.check(self.rejection_key, "CorrectionConfig.rejection_key")
        WEIGHT_MODES.check(self.weight_mode, "CorrectionConfig.weight_mode")
        ADVANTAGE_ESTIMATORS.check(self.advantage_estimator, "CorrectionConfig.advantage_estimator")
        if self.veto_threshold is not None and not 0 <= self.veto_threshold < 1:
            raise ValueError(f"CorrectionConfig.veto_threshold must be in [0, 1) or None, got {self.veto_threshold}")
        if not 0 < self.rejection_lower <= 1 <= self.rejection_upper:
            raise ValueError(
                "CorrectionConfig.rejection_lower/rejection_upper must satisfy 0 < lower <= 1 <= upper, got "
                f"{self.rejection_lower}, {self.rejection_upper}"
            )
        if self.rejection_key != RATIO_KEY and not (self.rejection_max_divergence or 0) > 0:
            raise ValueError(
                f"CorrectionConfig.rejection_max_divergence must be > 0 with rejection_key='{self.rejection_key}', "
                f"got {self.rejection_max_divergence}"
            )
        if not 0 <= self.weight_lower <= 1 <= self.weight_upper < float("inf"):
            raise ValueError(
                "CorrectionConfig.weight_lower/weight_upper must satisfy 0 <= lower <= 1 <= upper < inf, got "
                f"{self.weight_lower}, {self.weight_upper}"
            )
        if not self.advantage_eps >= 0:
            raise ValueError(f"CorrectionConfig.advantage_eps must be >= 0, got {self.advantage_eps}")
        uses_hook = CORRECTION_MODES.get(self.mode).uses_hook
        if uses_hook and not self.hook:
            raise ValueError(f"CorrectionConfig.hook must be a dotted path 'package.module.function' with "
                             f"mode='{self.mode}'")
        if self.hook and not uses_hook:
            raise ValueError(f"CorrectionConfig.hook is only used with {' or '.join(f'mode={m!r}' for m in hook_modes())}"
                             f", but mode='{self.mode}'")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
