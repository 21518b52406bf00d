"""The arms of an experiment by name (``ARMS``): each is a set of overrides of the base training recipe.

The claims they test (Sparse-RL, Luo et al. 2026): naive compressed-KV rollouts degrade GRPO (``naive`` vs
``dense``, and ``naive_harsh`` at a smaller budget as a dose arm); rejection + reweighting restores it
(``sparse_rl``, ``sparse_rl_snapkv``); RL beats the obvious alternative, more supervised training (``sft``).
Issue 27's arms run at budget levels chosen by the contamination rule (``naive_low``, ``sparse_rl_{low,mid,high}``)
or with the adaptive budget (``sparse_rl_adaptive``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparse_rl_megatron.utils.registry import Registry


@dataclass(frozen=True)
class Arm:
    """One arm: overrides of the base ``TrainConfig`` (nested mapping), or the supervised control."""

    description: str
    """One line for tables and logs."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Deep-merged over the base recipe."""
    sweeps: bool = False
    """Runs again at each budget of ``experiment.budgets``."""
    supervised: bool = False
    """The supervised control (no RL run)."""
    harsh: bool = False
    """Runs at the dose budget ``experiment.harsh_budget`` (B_h) instead of the recipe's."""
    level: str | None = None
    """Runs at the budget of this level of ``experiment.level_budgets`` (issue 27: ``low``, ``mid``, ``high``;
    with the adaptive budget: its start)."""


_RKV_NAIVE = {"rollout": {"compression": {"method": "rkv"}}, "correction": {"mode": "none"}}
_RKV_SPARSE_RL = {"rollout": {"compression": {"method": "rkv"}}, "correction": {"mode": "sparse_rl"}}
"""The overrides shared by the R-KV arms (budgets come from the recipe, the dose budget or a level)."""

ARMS: Registry[Arm] = Registry("experiment arm")
ARMS.add("dense", Arm("GRPO, dense rollouts", {"rollout": {"compression": {"method": "none"}},
                                               "correction": {"mode": "none"}}))
ARMS.add("naive", Arm("GRPO, R-KV rollouts, no correction", _RKV_NAIVE, sweeps=True))
ARMS.add("sparse_rl", Arm("Sparse-RL, R-KV rollouts", _RKV_SPARSE_RL, sweeps=True))
ARMS.add("sparse_rl_snapkv", Arm("Sparse-RL, SnapKV rollouts", {"rollout": {"compression": {"method": "snapkv"}},
                                                                "correction": {"mode": "sparse_rl"}}))
ARMS.add("naive_harsh", Arm("GRPO, R-KV rollouts at the harsher dose budget B_h, no correction", _RKV_NAIVE,
                            harsh=True))
ARMS.add("naive_low", Arm("GRPO, R-KV rollouts at the low budget level, no correction", _RKV_NAIVE, level="low"))
for _level in ("low", "mid", "high"):
    ARMS.add(f"sparse_rl_{_level}", Arm(f"Sparse-RL, R-KV rollouts at the {_level} budget level", _RKV_SPARSE_RL,
                                        level=_level))
ARMS.add("sparse_rl_adaptive", Arm(
    "Sparse-RL, R-KV rollouts, adaptive budget (rollout.adaptive_budget) starting at the mid budget level",
    {"rollout": {"compression": {"method": "rkv"}, "adaptive_budget": {"enabled": True}},
     "correction": {"mode": "sparse_rl"}}, level="mid"))
ARMS.add("sft", Arm("supervised, equal CPU time (or experiment.control.steps)", supervised=True))


@dataclass(frozen=True)
class ArmRun:
    """One run of an arm: its directory name under ``seed_<s>/`` and its KV budget (None: the recipe's)."""

    name: str
    arm: str
    budget: int | None = None

    @property
    def spec(self) -> Arm:
        return ARMS.get(self.arm)


def arm_runs(arms: list[str], budgets: list[int]) -> list[ArmRun]:
    """The runs of one seed in order: every arm, then the sweepable ones at each sweep budget."""
    runs = [ArmRun(a, a) for a in arms]
    runs += [ArmRun(f"{a}_B{b}", a, b) for b in budgets for a in arms if ARMS.get(a).sweeps]
    return runs
