"""The arms of an experiment by name (``ARMS``): each is a set of overrides of the base training recipe.

The claims they test (Sparse-RL, Luo et al. 2026): naive compressed-KV rollouts degrade GRPO (``naive`` vs
``dense``, and ``naive_harsh`` at a smaller budget as a dose arm); rejection + reweighting restores it
(``sparse_rl``, ``sparse_rl_snapkv``); RL beats the obvious alternative, more supervised training (``sft``).
Issue 27's arms run at budget levels chosen by the contamination rule (``naive_{low,mid,high}``,
``sparse_rl_{low,mid,high}``) or with the adaptive budget (``sparse_rl_adaptive``). The compressed arms sample with
the base recipe's compressor (``train.rollout.compression``: R-KV in the issue-20 and issue-27 recipes, StreamingLLM
in issue 39's), ``sparse_rl_snapkv`` with SnapKV.
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
    recipe_compressor: bool = False
    """Samples with the base recipe's compressor (which must compress: ``ExperimentConfig`` refuses ``none``)."""


_NAIVE = {"correction": {"mode": "none"}}
_SPARSE_RL = {"correction": {"mode": "sparse_rl"}}
"""The overrides shared by the compressed arms (the recipe's compressor; budgets from the recipe, the dose budget or
a level)."""

ARMS: Registry[Arm] = Registry("experiment arm")
ARMS.add("dense", Arm("GRPO, dense rollouts", {"rollout": {"compression": {"method": "none"}},
                                               "correction": {"mode": "none"}}))
ARMS.add("naive", Arm("GRPO, compressed rollouts, no correction", _NAIVE, sweeps=True, recipe_compressor=True))
ARMS.add("sparse_rl", Arm("Sparse-RL, compressed rollouts", _SPARSE_RL, sweeps=True, recipe_compressor=True))
ARMS.add("sparse_rl_snapkv", Arm("Sparse-RL, SnapKV rollouts", {"rollout": {"compression": {"method": "snapkv"}},
                                                                "correction": {"mode": "sparse_rl"}}))
ARMS.add("naive_harsh", Arm("GRPO, compressed rollouts at the harsher dose budget B_h, no correction", _NAIVE,
                            harsh=True, recipe_compressor=True))
for _level in ("low", "mid", "high"):
    ARMS.add(f"naive_{_level}", Arm(f"GRPO, compressed rollouts at the {_level} budget level, no correction", _NAIVE,
                                    level=_level, recipe_compressor=True))
    ARMS.add(f"sparse_rl_{_level}", Arm(f"Sparse-RL, compressed rollouts at the {_level} budget level", _SPARSE_RL,
                                        level=_level, recipe_compressor=True))
ARMS.add("sparse_rl_adaptive", Arm(
    "Sparse-RL, compressed rollouts, adaptive budget (rollout.adaptive_budget) starting at the mid budget level",
    {"rollout": {"adaptive_budget": {"enabled": True}}, "correction": {"mode": "sparse_rl"}}, level="mid",
    recipe_compressor=True))
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
