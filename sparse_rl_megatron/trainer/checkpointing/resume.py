"""Which checkpoint a run resumes from, and loading it: never a damaged one, never silently from step 0.

``choose`` (rank 0, before any model is built) looks at the files (``integrity.problem``):
- ``checkpoint.resume: never``: start from step 0; a path: that checkpoint, or one line saying what is wrong;
- ``auto``: the newest intact checkpoint of the run directory. Every newer step directory it passes over is
  named in one line with what is wrong, and the resume line says that the steps after the chosen one will be
  redone. When none is intact the run stops with one line (``RunFailed``), unless no checkpoint was ever
  complete (only interrupted saves): then it starts from step 0 and says so.
``load`` (every rank, once the learner is built) loads the chosen one; a checkpoint that turns out not to fit
(another model's architecture or tensor shapes, data that does not load) is named in one line and the next
older intact one is tried, on every rank alike; none left: ``RunFailed``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sparse_rl_megatron.trainer.checkpointing import checkpoints as C
from sparse_rl_megatron.trainer.checkpointing.integrity import problem
from sparse_rl_megatron.trainer.checkpointing.state import FORMAT_VERSION, TrainerState
from sparse_rl_megatron.trainer.runtime import distributed as D
from sparse_rl_megatron.utils.errors import RunFailed

if TYPE_CHECKING:
    from sparse_rl_megatron.learner.learner import Learner
    from sparse_rl_megatron.trainer.config import TrainConfig


class ResumingRun(Protocol):
    """What of a run ``load`` uses (``trainer/run.py``'s ``Run``)."""

    cfg: "TrainConfig"
    run_dir: Path
    learner: "Learner"

    def say(self, text: str) -> None: ...

@dataclass
class Choice:
    """Where a run starts: ``path`` None = step 0."""

    path: Path | None = None
    state: TrainerState | None = None
    notes: list[str] = field(default_factory=list)
    """What to tell the user (damaged or incomplete checkpoints passed over, which one is resumed)."""
    newest: int | None = None
    """Step of the newest step directory there was (to say which steps will be redone)."""
    rng_restored: bool = False
    """Set by ``load``: this rank's RNG states came from the checkpoint (False: it has none for this rank)."""


def _resumed(path: Path, state: TrainerState, newest: int | None, passed_over: bool) -> str:
    if not passed_over:
        return f"resuming from {path}"
    redone = f"step {state.step + 1}" + (f" to {newest}" if newest and newest > state.step + 1 else "")
    return f"resuming from {path}, the newest intact checkpoint: {redone} will be redone"


def choose(resume: str, run_dir: str | os.PathLike, below: int | None = None) -> Choice:
    """The checkpoint to resume from (see the module docstring); ``below``: only steps older than it."""
    if resume == "never":
        return Choice()
    if resume != "auto":
        path = C.resolve_resume(resume, run_dir)  # exists and has a state file, else a UserError
        state, wrong = _intact(path)
        if wrong:
            raise RunFailed(f"checkpoint.resume: {path} cannot be used: {wrong}")
        return Choice(path, state, [f"resuming from {path}"])
    dirs = [(step, path) for step, path in reversed(C.step_dirs(run_dir)) if below is None or step < below]
    choice = Choice(newest=dirs[0][0] if dirs else None)
    damaged = []
    for step, path in dirs:
        state, wrong = _intact(path)
        if wrong is None:
            choice.path, choice.state = path, state
            choice.notes.append(_resumed(path, choice.state, choice.newest, passed_over=bool(choice.notes)))
            return choice
        choice.notes.append(f"checkpoint {path} cannot be used: {wrong}")
        if C.is_complete(path):  # trainer_state.json, written last and atomically: a save that got that far completed
            damaged.append(f"{path.name}: {wrong}")
    if damaged:
        raise RunFailed(f"no intact checkpoint in {Path(run_dir) / C.CHECKPOINTS_DIR} ({'; '.join(damaged)}); "
                        "restore one, or start over with checkpoint.resume=never (earlier outputs are archived)")
    if choice.notes:
        choice.notes.append("no checkpoint was ever complete: starting from step 0")
    return choice


def _intact(path: Path) -> tuple[TrainerState | None, str | None]:
    """``(its trainer state, None)`` for an intact checkpoint, else ``(None, what is wrong)``."""
    wrong = problem(path, FORMAT_VERSION)
    if wrong:
        return None, wrong
    try:
        return TrainerState.read(path), None
    except ValueError as err:
        return None, f"its trainer state does not load ({err})"


def _why(err: BaseException) -> str:
    """One line for a load failure (torch.distributed.checkpoint's errors hold the failing rank's exception)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def load(run: ResumingRun, choice: Choice) -> Choice:
    """Load ``choice`` into ``run.learner`` and this rank's RNG (every rank); fall back to older intact
    checkpoints while one does not load. Returns what was loaded (``path`` None: nothing to load)."""
    while choice.path is not None:
        error = None
        try:
            run.learner.load(choice.path)
            if run.learner.steps != choice.state.learner_steps:
                error = (f"its learner files record {run.learner.steps} optimizer steps, its trainer state "
                         f"{choice.state.learner_steps}: parts of different saves")
        except BaseException as err:  # noqa: BLE001 - CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            error = _why(err)
        failed = [e for e in D.gather_objects(error) if e is not None]
        if not failed:
            choice.rng_restored = C.load_rng(choice.path, D.rank(), run.learner.device_facts.cuda)
            return choice
        bad, step = choice.path, choice.state.step

        def older() -> Choice:
            if run.cfg.checkpoint.resume != "auto":
                raise RunFailed(f"checkpoint.resume: {bad} does not load into this run's model: {failed[0]}")
            try:
                nxt = choose("auto", run.run_dir, below=step)
            except RunFailed as err:
                raise RunFailed(f"checkpoint {bad} does not load into this run's model ({failed[0]}); {err}") from None
            if nxt.path is None:
                raise RunFailed(f"checkpoint {bad} does not load into this run's model ({failed[0]}), and no older "
                                "checkpoint is intact; start over with checkpoint.resume=never")
            nxt.notes.insert(0, f"checkpoint {bad} cannot be used: it does not load into this run's model "
                                f"({failed[0]})")
            nxt.notes[-1] = _resumed(nxt.path, nxt.state, max(choice.newest or step, step), passed_over=True)
            return nxt

        choice = D.on_main(older)
        for note in choice.notes:
            run.say(note)
    return choice
