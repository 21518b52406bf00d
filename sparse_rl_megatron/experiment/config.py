"""Typed configuration of ``sparse-rl experiment``: the base training recipe plus what varies across arms."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.experiment.analysis import DESIGNS, design_name
from sparse_rl_megatron.experiment.arms import ARMS
from sparse_rl_megatron.tasks import is_task_ref
from sparse_rl_megatron.trainer.config import TrainConfig

DEFAULT_ARMS = ("dense", "naive", "sparse_rl", "sparse_rl_snapkv", "sft")


@dataclass
class ControlConfig:
    """The equal-time supervised control: ``tasks/sft.py`` continued from the arms' shared warm start."""

    reference_arm: str = "sparse_rl"
    """The RL arm whose CPU time (outside evaluation) the control gets; it must run before the control."""
    steps: int | None = None
    """Supervised steps (None: the reference arm's CPU time / the warm start's CPU seconds per step)."""
    options: dict[str, Any] = field(default_factory=dict)
    """``SFTConfig`` fields over the task's warm-start recipe (e.g. ``lr``), except ``steps``."""

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"ControlConfig.steps must be >= 1 or None (equal CPU time), got {self.steps}")
        if "steps" in self.options:
            raise ValueError("ControlConfig.options: set the control's length with control.steps, not options.steps")


RULE_KINDS = ("veto_reward", "contamination")
"""``veto_reward``: issue 20's B* and B_h; ``contamination``: issue 27's budget levels (``budget_rule.py``)."""


@dataclass
class BudgetRuleConfig:
    """The pre-registered choice of the KV budgets from ``sparse-rl mismatch`` on the seeds' warm starts
    (``budget_rule.py``). ``kind: veto_reward`` (issue 20): the main budget B* is the smallest candidate whose
    pooled would-be veto rate and sparse / dense T = 1 reward ratio pass both bounds (none passes: the largest
    candidate); the dose budget B_h = max(min_budget, B* // 2). ``kind: contamination`` (issue 27): each level of
    ``levels`` gets the candidate whose pooled contamination share is nearest its target; B* is ``main_level``'s
    budget and B_h the smallest level's."""

    kind: str = "veto_reward"
    """``veto_reward`` or ``contamination`` (``RULE_KINDS``)."""
    levels: dict[str, float] = field(default_factory=dict)
    """``kind: contamination``: level name -> target share of contaminated sequences (any token rho < 0.5),
    e.g. ``{low: 0.5, mid: 0.25, high: 0.1}``; the arms with that ``level`` run at its budget."""
    main_level: str = "mid"
    """``kind: contamination``: the level whose budget is B* (the base recipe's rollout and evaluation budget)."""
    candidates: list[int] = field(default_factory=lambda: [6, 8, 12, 16])
    """KV budgets tried, smallest first."""
    max_would_veto: float = 0.2
    """Largest pooled share of sequences the veto (rho < 1e-4) would drop."""
    min_reward_ratio: float = 0.8
    """Smallest (mean T = 1 reward under the budget) / (mean T = 1 reward with a dense cache)."""
    min_budget: int = 3
    """Smallest dose budget (above the compressor's window)."""
    prompts: int = 32
    """Training prompts per seed (the run's first ones; ``rollout.prompts_per_step`` of the study)."""
    samples: int = 8
    """Samples per prompt."""
    seeds: list[int] | None = None
    """The seeds pooled (None: ``experiment.seeds``); the rule is written once all of them are measured, so
    processes measuring disjoint seeds cannot choose from a part of them."""

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"BudgetRuleConfig.kind must be one of {', '.join(RULE_KINDS)}, got '{self.kind}'")
        if self.kind == "contamination":
            if not self.levels or any(not 0 <= t <= 1 for t in self.levels.values()):
                raise ValueError(f"BudgetRuleConfig.levels must map level names to target shares in [0, 1] for "
                                 f"kind contamination, got {self.levels}")
            if self.main_level not in self.levels:
                raise ValueError(f"BudgetRuleConfig.main_level '{self.main_level}' must be one of the levels "
                                 f"{sorted(self.levels)}")
        if not self.candidates or sorted(set(self.candidates)) != self.candidates or self.candidates[0] < 1:
            raise ValueError(f"BudgetRuleConfig.candidates must be distinct positive budgets, smallest first, got "
                             f"{self.candidates}")
        if not 0 <= self.max_would_veto <= 1 or not 0 <= self.min_reward_ratio:
            raise ValueError(f"BudgetRuleConfig needs max_would_veto in [0, 1] and min_reward_ratio >= 0, got "
                             f"{self.max_would_veto}, {self.min_reward_ratio}")
        if self.prompts < 1 or self.samples < 2 or self.min_budget < 1:
            raise ValueError(f"BudgetRuleConfig needs prompts >= 1, samples >= 2, min_budget >= 1, got "
                             f"{self.prompts}, {self.samples}, {self.min_budget}")


@dataclass
class StudyConfig:
    """After the arms (``study.py``): the compounding test (``sparse-rl mismatch`` at the main budget on the warm
    start and each arm's checkpoints) and the final models evaluated under other KV caches."""

    checkpoint_steps: list[int] = field(default_factory=lambda: [75, 150])
    """RL steps whose checkpoints are measured (step 0, the warm start, always is); they must be saved."""
    prompts: int = 32
    """Training prompts per measurement (the run's first ones)."""
    samples: int = 8
    """Samples per prompt."""
    caches: list[CompressionConfig] = field(default_factory=list)
    """KV caches the final models are evaluated under (greedy, the held-out problems), besides the arms' own."""

    def __post_init__(self) -> None:
        if any(k < 1 for k in self.checkpoint_steps) or self.prompts < 1 or self.samples < 2:
            raise ValueError(f"StudyConfig needs checkpoint_steps >= 1, prompts >= 1, samples >= 2, got "
                             f"{self.checkpoint_steps}, {self.prompts}, {self.samples}")
        dense = [c.describe() for c in self.caches if c.is_dense]
        if dense:
            raise ValueError(f"StudyConfig.caches are compressed caches (dense inference is evaluated anyway), got "
                             f"{dense}")


@dataclass
class ExperimentSection:
    """Which arms run, on which seeds, where."""

    out: str = "runs/experiments/cpu_claims"
    """Experiment directory: ``seed_<s>/<arm>/`` run directories, ``results.{md,json}``, ``figure.png``."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Seeds; each seed builds its own warm start (model init, supervised stage, prompt order, sampling)."""
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))
    """Arms (``experiment.arms.ARMS``), run in this order for each seed (the control after its reference)."""
    budgets: list[int] = field(default_factory=list)
    """Budget sweep: the sweepable arms (naive, sparse_rl) again at each of these KV budgets."""
    control: ControlConfig = field(default_factory=ControlConfig)
    """The supervised control."""
    harsh_budget: int | None = None
    """KV budget B_h of the dose arm ``naive_harsh`` (with ``budgets_from_rule``: the rule's)."""
    budgets_from_rule: bool = False
    """Take B* (rollout and evaluation budget), B_h, the level budgets and the study's caches from
    ``<out>/budget_rule.json``, written by ``--stage budgets``; the arms refuse to run without it."""
    level_budgets: dict[str, int] = field(default_factory=dict)
    """KV budget of each budget level (the arms with a ``level``, e.g. ``sparse_rl_low``); with
    ``budgets_from_rule``: the rule's."""
    analysis: str = "cpu_claims"
    """The pre-registered tests ``--stage report`` decides, a name in ``analysis.DESIGNS`` (an earlier name in
    ``analysis.RENAMED_DESIGNS`` is read as its current one)."""
    budget_rule: BudgetRuleConfig = field(default_factory=BudgetRuleConfig)
    """How ``--stage budgets`` chooses B* and B_h."""
    study: StudyConfig = field(default_factory=StudyConfig)
    """What ``--stage study`` measures after the arms."""

    def __post_init__(self) -> None:
        if not self.seeds or not self.arms:
            raise ValueError("ExperimentSection needs at least one seed and one arm")
        for name in self.arms:
            ARMS.check(name, "experiment.arms")
        if len(set(self.arms)) != len(self.arms) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"experiment.arms and experiment.seeds must not repeat, got {self.arms}, {self.seeds}")
        if any(b < 1 for b in self.budgets):
            raise ValueError(f"experiment.budgets must be positive KV budgets, got {self.budgets}")
        harsh = [a for a in self.arms if ARMS.get(a).harsh]
        if harsh and not self.budgets_from_rule and (self.harsh_budget is None or self.harsh_budget < 1):
            raise ValueError(f"experiment.harsh_budget must be a positive KV budget for the dose arm(s) {harsh} "
                             f"(or set experiment.budgets_from_rule), got {self.harsh_budget}")
        leveled = [a for a in self.arms if ARMS.get(a).level and ARMS.get(a).level not in self.level_budgets]
        if leveled and not self.budgets_from_rule:
            raise ValueError(f"experiment.level_budgets must give the budget of the level(s) of {leveled} "
                             f"(or set experiment.budgets_from_rule), got {self.level_budgets}")
        if any(b < 1 for b in self.level_budgets.values()):
            raise ValueError(f"experiment.level_budgets must be positive KV budgets, got {self.level_budgets}")

        self.analysis = DESIGNS.check(design_name(self.analysis), "experiment.analysis")
        supervised = [a for a in self.arms if ARMS.get(a).supervised]
        if supervised and self.control.steps is None:
            ref = self.control.reference_arm
            if ref not in self.arms or self.arms.index(ref) > self.arms.index(supervised[0]):
                raise ValueError(f"experiment.control.reference_arm '{ref}' must be among experiment.arms and run "
                                 f"before '{supervised[0]}' (or set experiment.control.steps)")


@dataclass
class ExperimentConfig:
    """One ``sparse-rl experiment``: the base ``sparse-rl train`` recipe and the experiment's arms and seeds."""

    DERIVED_KEYS: ClassVar[dict[str, str]] = {f"train.{k}": f"train.{v}" for k, v in TrainConfig.DERIVED_KEYS.items()}

    experiment: ExperimentSection = field(default_factory=ExperimentSection)
    """Arms, seeds, budget sweep, control, output directory."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The base training recipe every arm overrides; ``model_path: task:<name>`` (its warm start is shared)."""

    def __post_init__(self) -> None:
        if not is_task_ref(self.train.model_path):
            raise ValueError(f"train.model_path must be task:<name> (the arms share its warm start), got "
                             f"'{self.train.model_path}'")
        compressed = [a for a in self.experiment.arms if ARMS.get(a).recipe_compressor]
        if compressed and self.train.rollout.compression.is_dense:
            raise ValueError(f"train.rollout.compression.method must name a compressor for the compressed arm(s) "
                             f"{', '.join(compressed)}, which sample with the recipe's; got "
                             f"'{self.train.rollout.compression.method}'")
