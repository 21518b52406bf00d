"""The trainer's state in a checkpoint (``trainer_state.json``): one typed home, captured from a run and restored
into one here.

Everything of a run's progress a checkpoint keeps besides the learner's own files and the RNG streams: the
rollout step, the weight version the engines serve, the learner's optimizer-step count, the seed, the position in
the prompt order, the adaptive budget controller's state, the partial rollouts' samples in flight, and what the save recorded about itself (the world size,
every file's size for the integrity check, the format version). Adding a field is an edit of this file: the field,
a line in ``capture`` and one in ``restore``.
"""
from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from sparse_rl_megatron.trainer.checkpointing.integrity import STATE_FILE

if TYPE_CHECKING:
    from sparse_rl_megatron.compression.budget_controller import BudgetController
    from sparse_rl_megatron.trainer.runtime.prompts import PromptOrder

FORMAT_VERSION = 1
"""Of ``trainer_state.json``: a checkpoint of another version is refused (``integrity.problem``)."""


class LearnerSteps(Protocol):
    steps: int
    """Optimizer steps taken."""


class InFlight(Protocol):
    """The partial rollouts' samples in flight (``trainer/partial_rollouts.py``'s ``PartialRollouts``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointedRun(Protocol):
    """What of a run its trainer state is captured from and restored into (``trainer/run.py``'s ``Run``)."""

    step: int
    learner: LearnerSteps
    prompts: "PromptOrder | None"
    """The prompt order (rank 0 only)."""
    budget_controller: "BudgetController | None"
    """The adaptive budget's controller (None when off)."""
    partial: InFlight | None
    """The partial rollouts' groups in flight (None when ``rollout.partial`` is off)."""


@dataclass
class TrainerState:
    """``trainer_state.json``, written last by rank 0 (its presence marks a complete checkpoint)."""

    step: int
    """Rollout steps completed."""
    weight_version: int
    """The weight version the engines serve after this step (= step: a resumed run's engines serve ``step``; a
    state where the two differ is refused when read)."""
    learner_steps: int
    """Optimizer steps the learner has taken (the learner's own files record the same count: ``resume.load``
    refuses a checkpoint whose two counts differ, its parts are of different saves)."""
    seed: int
    """The run's seed."""
    data: dict[str, Any]
    """The prompt order's position (``PromptOrder.state_dict``)."""
    budget_controller: dict[str, Any] | None = None
    """The adaptive budget controller's state (``BudgetController.state_dict``); None when it is off."""
    partial: dict[str, Any] | None = None
    """The partial rollouts' samples in flight and next group id (``PartialRollouts.state_dict``); None when off."""
    world_size: int = 1
    """Ranks that wrote the checkpoint (RNG states exist for each)."""
    files: dict[str, int] = field(default_factory=dict)
    """Every other file of the checkpoint and its size (``integrity.py``)."""
    format_version: int = FORMAT_VERSION

    @classmethod
    def capture(cls, run: CheckpointedRun, step: int, seed: int) -> "TrainerState":
        """Rank 0: the state of ``run`` after ``step`` (``world_size`` and ``files`` are the save's)."""
        return cls(step=step, weight_version=step, learner_steps=run.learner.steps, seed=seed,
                   data=run.prompts.state_dict(),
                   budget_controller=None if run.budget_controller is None else run.budget_controller.state_dict(),
                   partial=None if run.partial is None else run.partial.state_dict())

    def restore(self, run: CheckpointedRun, world_size: int) -> list[str]:
        """Into ``run`` (every rank reads the same file; the prompt order lives on rank 0 only): its step, the
        budget controller and the prompt position. Returns warnings for the user."""
        warnings = []
        run.step = self.step
        if run.budget_controller is not None:
            if self.budget_controller is not None:
                run.budget_controller.load_state_dict(self.budget_controller)
            else:
                warnings.append(f"the checkpoint has no adaptive budget state: the budget restarts at "
                                f"{run.budget_controller.budget}")
        if run.partial is not None:
            if self.partial is not None:
                run.partial.load_state_dict(self.partial)
            else:
                warnings.append("the checkpoint was saved with rollout.partial off: no samples in flight to continue")
        elif self.partial is not None and self.partial["in_flight"]:
            warnings.append(f"rollout.partial is off now: the checkpoint's {len(self.partial['in_flight'])} samples in "
                            "flight are dropped")
        if run.prompts is not None:
            warnings += run.prompts.load_state_dict(self.data)
            if self.world_size != world_size:
                warnings.append(f"the checkpoint was written by {self.world_size} ranks, this run has {world_size}: "
                                f"RNG states are not all restored")
        return warnings

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, ckpt: "str | os.PathLike") -> "TrainerState":
        """The trainer state of checkpoint ``ckpt``; ``ValueError`` naming what is wrong (no file, not JSON, another
        format version, another shape)."""
        path = Path(ckpt) / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path} cannot be read ({err})") from None
        if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
            version = state.get("format_version") if isinstance(state, dict) else None
            raise ValueError(f"{path}: format_version {version} is not {FORMAT_VERSION}, which this version writes "
                             f"and reads")
        try:
            return cls.from_json(state)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> "TrainerState":
        """From a ``trainer_state.json``; ``ValueError`` naming what is missing or unknown."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing, unknown = sorted(required - state.keys()), sorted(state.keys() - names)
        if missing or unknown:
            raise ValueError(f"not a trainer state of this version: "
                             + "; ".join(filter(None, [missing and f"missing {', '.join(missing)}",
                                                       unknown and f"unknown {', '.join(unknown)}"])))
        if state["weight_version"] != state["step"]:
            raise ValueError(f"weight_version {state['weight_version']} is not its step {state['step']} (the engines "
                             f"serve the weights of the step saved)")
        return cls(**state)
