"""Typed configuration of ``sparse-rl experiment``: the base training recipe plus what varies across arms."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

    def __post_init__(self) -> None:
        from sparse_rl_megatron.experiment.arms import ARMS

        if not self.seeds or not self.arms:
            raise ValueError("ExperimentSection needs at least one seed and one arm")
        for name in self.arms:
            ARMS.check(name, "experiment.arms")
        if len(set(self.arms)) != len(self.arms) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"experiment.arms and experiment.seeds must not repeat, got {self.arms}, {self.seeds}")
        if any(b < 1 for b in self.budgets):
            raise ValueError(f"experiment.budgets must be positive KV budgets, got {self.budgets}")
        supervised = [a for a in self.arms if ARMS.get(a).supervised]
        if supervised and self.control.steps is None:
            ref = self.control.reference_arm
            if ref not in self.arms or self.arms.index(ref) > self.arms.index(supervised[0]):
                raise ValueError(f"experiment.control.reference_arm '{ref}' must be among experiment.arms and run "
                                 f"before '{supervised[0]}' (or set experiment.control.steps)")


@dataclass
class ExperimentConfig:
    """One ``sparse-rl experiment``: the base ``sparse-rl train`` recipe and the experiment's arms and seeds."""

    experiment: ExperimentSection = field(default_factory=ExperimentSection)
    """Arms, seeds, budget sweep, control, output directory."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The base training recipe every arm overrides; ``model_path: task:<name>`` (its warm start is shared)."""

    def __post_init__(self) -> None:
        from sparse_rl_megatron.tasks import is_task_ref

        if not is_task_ref(self.train.model_path):
            raise ValueError(f"train.model_path must be task:<name> (the arms share its warm start), got "
                             f"'{self.train.model_path}'")
