"""An adaptive KV budget: after each step's dense recompute, set the next step's budget B so that a measured
mismatch signal stays at a target (issue 27).

Why: under Sparse-RL the mismatch between the compressed sampler and the dense policy compounds over training
(issue 20: would-be veto 14% in steps 1-10, 37% in steps 141-150), so a budget that is safe at step 0 is not
safe at step 150. The controller raises B when the signal is worse than its target and lowers it when better.

Rule (an integral controller on log B, a "multiplicative" update)::

    e_t      = direction * (signal_t - target)              # > 0: mismatch worse than wanted -> more budget
    e_t      = 0 if |signal_t - target| <= deadband          # noise band: hold
    step_t   = clip(gain * e_t, -log(1 + max_change), +log(1 + max_change))
    u_{t+1}  = clip(u_t + step_t, log B_min, log B_max)      # continuous state
    B_{t+1}  = round(exp(u_{t+1}) / granule) * granule      # quantised, clipped to [B_min, B_max], but only
               if |exp(u_{t+1}) - B_t| >= granule, else B_t  # when a whole granule away (hysteresis)

The continuous state ``u`` is kept apart from the quantised budget, so small errors accumulate instead of
being lost to rounding, and the hysteresis keeps the budget from dithering between two neighbouring granules
on noise (simulated with binomial noise over 64 sequences, 150 steps, 10 seeds: 5-12 direction changes
instead of 21-42 without it, at the same mean distance from the target, 0.03).
Near a monotone budget -> signal map with local slope ``k = |d signal / d log B|`` the error evolves as
``e_{t+1} = (1 - gain k) e_t``: it converges without overshoot when ``gain k <= 1`` and within the deadband it
stops. The slew limit ``max_change`` bounds how far one noisy step can move B.

Defaults, from the issue-27 audit of the issue-20 warm starts (modchain task, R-KV): the share of sequences
with any token rho < 0.5 ("contaminated") was 66% at B = 12, 54% at 16, 38% at 24, 18% at 32; contaminated
sequences earned far less reward than clean ones (0.18 vs 0.49 at B = 12) until about B = 32, where the gap
vanished; the veto rate (12.1%, 7.0%, 1.6%, 0.4%) tracked it poorly. Hence:

- signal ``contaminated_frac``, target 0.2: about the contamination where the reward gap vanished (18% at B=32);
- gain 0.5: the measured slope per unit of log B is 0.42 (B 12->16), 0.39 (16->24), 0.70 (24->32), so
  ``gain k`` is 0.2-0.35 < 1: no overshoot, the error shrinks by 20-35% per step (B 12 -> 32 in about 10
  steps), and one measurement's noise (sd 0.05) moves B by about 2.5%, well under a granule at B = 32
  (gain 1.0 converges faster but moves the budget about twice as often on noise);
- deadband 0.05: the sampling noise of a fraction near 0.2 over 64 sequences, ``sqrt(0.2 * 0.8 / 64) = 0.05``;
- max_change 0.25: at most +-25% per step (the audit's budgets are 33-50% apart, so two steps cross one gap);
- granule 4: the audit's budgets are multiples of 4; use the engine's page / alignment size for large B.

Framework-free (stdlib only); the state is a small JSON-able dict (``state_dict`` / ``load_state_dict``), so a
resumed run continues with the same budgets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.utils.registry import Registry


_ROUNDING = 1e-9
"""Relative slack of the hysteresis test: exp(log(16)) is 15.999999999999998, still a whole granule from 15."""


@dataclass(frozen=True)
class BudgetSignal:
    """A per-step mismatch statistic the controller can hold at a target."""

    metric: str
    """The metrics key it is read from (computed after the dense recompute, ``algo/metrics.py`` / ``diagnostics.py``)."""
    higher_is_worse: bool
    """True when a larger value means more mismatch (so the budget must grow)."""
    doc: str = ""


SIGNALS: Registry[BudgetSignal] = Registry("adaptive budget signal")
SIGNALS.add("contaminated_frac", BudgetSignal(
    MN.SPARSE_CONTAMINATED_FRAC, True, "share of sequences with any token rho < 0.5 (the issue-27 audit's signal)"))
SIGNALS.add("veto_frac", BudgetSignal(
    MN.SPARSE_WOULD_VETO_FRAC, True, "share of sequences the veto would drop (any rho < veto threshold), every mode"))
SIGNALS.add("rho_p1", BudgetSignal(MN.SPARSE_RHO_P1, False, "1st percentile of rho over response tokens"))
SIGNALS.add("token_below_frac", BudgetSignal(
    MN.SPARSE_TOKEN_BELOW_FRAC, True, "share of response tokens with rho < correction.rejection_lower (0.5): a "
    "per-token rate, which does not saturate as responses grow long (issue 39)"))
SIGNALS.add("kl_k3", BudgetSignal(
    MN.SPARSE_KL_K3, True, "mean over response tokens of k3 = rho - 1 - log rho, an estimate of KL(sparse sampler "
    "|| dense policy) from the sampled tokens (issue 39)"))


def read_signal(name: str, metrics: Mapping[str, float]) -> float:
    """The value of signal ``name`` in a step's metrics (KeyError naming the missing key)."""
    key = SIGNALS.get(name).metric
    if key not in metrics:
        raise KeyError(f"adaptive budget signal '{name}' reads metric '{key}', which this step did not log")
    return float(metrics[key])


@dataclass
class AdaptiveBudgetConfig:
    """The adaptive KV budget (``rollout.adaptive_budget``); off by default (the fixed ``compression.budget``)."""

    enabled: bool = False
    """Adapt the budget each step (the first step samples with ``compression.budget``)."""
    signal: str = "contaminated_frac"
    """Signal held at ``target`` (``SIGNALS``): ``contaminated_frac``, ``veto_frac``, ``rho_p1``, ``token_below_frac``
    or ``kl_k3``."""
    target: float = 0.2
    """Wanted value of the signal (a fraction; for ``rho_p1`` a ratio)."""
    min_budget: int = 16
    """B_min: the smallest budget the controller sets (must be > ``compression.window``)."""
    max_budget: int = 4096
    """B_max: the largest budget the controller sets (sizes the engine's worst case)."""
    gain: float = 0.5
    """Change of log B per unit of signal error (integral gain)."""
    deadband: float = 0.05
    """No change while ``|signal - target| <= deadband`` (absorbs sampling noise)."""
    max_change: float = 0.25
    """Largest relative change of the continuous state per step (0.25: x1.25 or /1.25; B itself may move up to
    a granule more, what the hysteresis held back)."""
    granule: int = 4
    """Budgets are multiples of this (page / alignment size of the engine)."""

    def __post_init__(self) -> None:
        SIGNALS.check(self.signal, field="AdaptiveBudgetConfig.signal")
        for name in ("min_budget", "max_budget", "granule"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AdaptiveBudgetConfig.{name} must be an int >= 1; got {value!r}")
        if self.max_budget < self.min_budget:
            raise ValueError(f"AdaptiveBudgetConfig.max_budget ({self.max_budget}) must be >= min_budget ({self.min_budget})")
        if self.min_budget % self.granule or self.max_budget % self.granule:
            raise ValueError(f"AdaptiveBudgetConfig.min_budget and max_budget must be multiples of granule "
                             f"({self.granule}); got {self.min_budget}, {self.max_budget}")
        if not math.isfinite(self.target):
            raise ValueError(f"AdaptiveBudgetConfig.target must be a finite number; got {self.target}")
        if not (self.gain > 0 and math.isfinite(self.gain)):
            raise ValueError(f"AdaptiveBudgetConfig.gain must be > 0; got {self.gain}")
        if not self.deadband >= 0:
            raise ValueError(f"AdaptiveBudgetConfig.deadband must be >= 0; got {self.deadband}")
        if not 0 < self.max_change <= 10:
            raise ValueError(f"AdaptiveBudgetConfig.max_change must be in (0, 10]; got {self.max_change}")

    def clamp(self, budget: float) -> int:
        """``budget`` rounded to the nearest granule and clipped to [min_budget, max_budget]."""
        quantised = int(round(budget / self.granule)) * self.granule
        return max(self.min_budget, min(self.max_budget, quantised))


class BudgetController:
    """The rule of the module docstring. ``budget`` is the budget to sample the next step with."""

    def __init__(self, config: AdaptiveBudgetConfig, initial_budget: int):
        self.config = config
        start = config.clamp(initial_budget)
        self._log_budget = math.log(start)
        self.budget = start
        self.updates = 0
        self.last_signal: float | None = None

    def update(self, signal: float) -> int:
        """Feed the signal measured on the step just sampled with ``self.budget``; returns the next budget.

        A NaN signal (nothing measurable this step, e.g. no response tokens) leaves the budget as it is."""
        c = self.config
        self.updates += 1
        self.last_signal = float(signal)
        if math.isnan(signal):
            return self.budget
        diff = signal - c.target
        if abs(diff) > c.deadband:
            error = diff if SIGNALS.get(c.signal).higher_is_worse else -diff
            limit = math.log1p(c.max_change)
            step = max(-limit, min(limit, c.gain * error))
            self._log_budget = max(math.log(c.min_budget), min(math.log(c.max_budget), self._log_budget + step))
            wanted = math.exp(self._log_budget)
            if abs(wanted - self.budget) >= c.granule * (1 - _ROUNDING):  # hysteresis: move only a whole granule
                self.budget = c.clamp(wanted)
        return self.budget

    def update_from_metrics(self, metrics: Mapping[str, float]) -> int:
        """:meth:`update` with the configured signal read from a step's metrics."""
        return self.update(read_signal(self.config.signal, metrics))

    def metrics(self) -> dict[str, float]:
        """``rollout/budget`` (of the step just sampled, before ``update``), the signal's target."""
        return {MN.ROLLOUT_BUDGET: float(self.budget), MN.ROLLOUT_BUDGET_TARGET: float(self.config.target)}

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: restoring it gives the same budgets for the same signals."""
        return {"log_budget": self._log_budget, "budget": self.budget, "updates": self.updates,
                "last_signal": self.last_signal}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._log_budget = float(state["log_budget"])
        self.budget = int(state["budget"])
        self.updates = int(state["updates"])
        self.last_signal = None if state.get("last_signal") is None else float(state["last_signal"])
