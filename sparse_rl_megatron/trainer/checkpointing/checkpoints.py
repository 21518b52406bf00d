"""Training checkpoints: ``run_dir/checkpoints/step_<k>/`` after k rollout steps, and resuming from them.

A checkpoint directory is, in the order it is written:
1. the learner's own atomic ``Learner.save`` (model, optimizer, LR schedule, learner counters; torch_dist,
   loadable at any TP x PP, and itself a model directory ``sparse-rl eval`` / ``convert`` accept);
2. ``rng/rank<r>.pt``: the python, numpy and torch RNG states of every rank (written atomically per rank);
3. ``trainer_state.json``, LAST, by rank 0 after a barrier, atomically (tmp + rename): ``state.TrainerState``, the
   rollout step, the data position, the weight version, the world size, and the size of every other file
   (``files``, checked before a resume: ``integrity.py``). Only a directory that has it is *complete*; a kill at any earlier
   moment leaves an incomplete directory that resume skips, saying so (and the next save replaces).
A save that cannot write (disk full, I/O error, permission) fails on every rank with one line (``SaveFailed``),
removes what it wrote and leaves the earlier checkpoints as they were. ``resume: auto`` picks the newest intact
one (``resume.py``); the last ``keep_last`` complete ones are kept.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from sparse_rl_megatron.trainer.checkpointing.integrity import STATE_FILE, file_sizes
from sparse_rl_megatron.trainer.checkpointing.state import FORMAT_VERSION, TrainerState
from sparse_rl_megatron.trainer.runtime import distributed as D
from sparse_rl_megatron.utils.atomic_write import atomic_write, write_json_atomic
from sparse_rl_megatron.utils.device import cuda_present
from sparse_rl_megatron.utils.errors import RunFailed, UserError
from dataclasses import replace
from sparse_rl_megatron.learner.save_children import WriterDied

CHECKPOINTS_DIR = "checkpoints"
RNG_DIR = "rng"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step}"


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def step_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every ``step_<k>`` directory (complete or not), oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    return sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ())
                  if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every complete checkpoint, oldest first."""
    return [(step, path) for step, path in step_dirs(run_dir) if is_complete(path)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from (None: start from scratch), per ``checkpoint.resume``."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"checkpoint.resume: {path} does not exist (valid: auto, never, or a checkpoint directory)")
    if not is_complete(path):
        raise UserError(f"checkpoint.resume: {path} is not a complete training checkpoint (no {STATE_FILE}; "
                        "it was interrupted while saving, or is not a checkpoint of `sparse-rl train`)")
    return path


def read_state(ckpt: str | os.PathLike) -> TrainerState:
    """The trainer state of a complete checkpoint; ``UserError`` when it is of another version or not one."""
    try:
        return TrainerState.read(ckpt)
    except ValueError as err:
        raise UserError(str(err)) from None


def capture_rng(cuda: bool | None = None) -> dict[str, Any]:
    """This process's python, numpy and torch (CPU, and CUDA when ``cuda``; None: ``cuda_present()``) RNG states."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if cuda_present() if cuda is None else cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any], cuda: bool | None = None) -> None:
    """Set the states ``capture_rng`` took; the CUDA one only when ``cuda`` (None: ``cuda_present()``)."""
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and (cuda_present() if cuda is None else cuda):
        torch.cuda.set_rng_state(state["cuda"])


class SaveFailed(RunFailed):
    """A checkpoint could not be written (disk full, I/O error, no permission, a killed writer); nothing of it was
    kept."""


def save(run_dir: str | os.PathLike, step: int, learner, trainer_state: TrainerState, keep_last: int) -> Path:
    """Write ``step_<step>`` (collective: every rank calls it), then prune to the last ``keep_last``.

    A write that fails on any rank (``OSError``: ENOSPC, EIO, EACCES, ...) fails the save on every rank with
    ``SaveFailed`` (one line naming the error); the partial checkpoint is removed, the earlier ones are untouched
    (they are pruned only after a save succeeded)."""
    out = step_dir(run_dir, step)
    if D.is_main() and out.exists() and not is_complete(out):
        shutil.rmtree(out)  # an earlier, interrupted save of this step: start it over
    D.wait_for_main()
    try:
        _agreed(out, lambda: learner.save(out))
        _agreed(out, lambda: _write_rng(out, D.rank(), learner.device_facts.cuda))
        _agreed(out, lambda: _write_state(out, trainer_state) if D.is_main() else None)
    except SaveFailed:
        if D.is_main():
            from sparse_rl_megatron.learner.checkpoint import _staging_dir

            for partial in (out, _staging_dir(out)):  # the learner stages its files there
                shutil.rmtree(partial, ignore_errors=True)
        D.wait_for_main()
        raise
    if D.is_main():
        prune(run_dir, keep_last)
    D.wait_for_main()
    return out


def _write_rng(out: Path, rank: int, cuda: bool) -> None:
    rng_dir = out / RNG_DIR
    rng_dir.mkdir(exist_ok=True)
    atomic_write(rng_dir / f"rank{rank}.pt", lambda f: torch.save(capture_rng(cuda), f))


def _write_state(out: Path, state: TrainerState) -> None:
    """Rank 0, after every rank wrote its files: the trainer state with the world size and the size of every file
    (written last)."""
    write_json_atomic(out / STATE_FILE, replace(state, world_size=D.world_size(), files=file_sizes(out)).to_json())


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^\n]*)")


def _behind(err: BaseException):
    """``(exception, rank)`` for ``err``, its causes, and the failures megatron / torch.distributed.checkpoint
    gathered from writer processes and ranks (``rank``: the rank a gathered failure came from, else None; a
    gathered failure travels pickled, without its cause)."""
    seen: set[int] = set()
    todo: list[tuple[BaseException | None, int | None]] = [(err, None)]
    while todo:
        e, rank = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e, rank
        todo += [(e.__cause__, rank), (e.__context__, rank)]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [(f[0] if isinstance(f, tuple) else f, r if isinstance(r, int) else rank)
                     for r, f in failures.items()]


def _gathered(e: BaseException) -> bool:
    return isinstance(getattr(e, "failures", None), dict)


def save_failure(err: BaseException) -> tuple[int | None, str] | None:
    """Why a save failed, in one line, where the reason is outside the program: a disk error (an ``OSError``
    behind ``err``, or its text where megatron gathered it pickled: ``RuntimeError('Worker failure: [Errno 28] No
    space left on device')`` keeps only the text) or a writer process that died (``save_children.WriterDied``:
    killed, e.g. by the OOM killer), with the rank it happened on where megatron gathered it from another rank
    (else None); None for anything else (a bug: the error itself is raised)."""
    for e, rank in _behind(err):
        if isinstance(e, OSError):
            return rank, str(e)
        if _gathered(e):
            continue
        if (m := _ERRNO_TEXT.search(str(e))) is not None:
            return rank, str(OSError(int(m.group(1)), m.group(2)))
        if (m := WriterDied.TEXT.search(str(e))) is not None:
            return rank, m.group(0)
    return None


def _agreed(out: Path, write) -> None:
    """Run this rank's part of a save step, then agree across ranks: if a write failed on a rank for a reason
    outside the program (``save_failure``: a disk error, a killed writer), every rank raises ``SaveFailed``
    naming the rank it happened on (instead of the others waiting in the next collective)."""
    error: BaseException | None = None
    try:
        write()
    except BaseException as err:  # noqa: BLE001 - CheckpointException is a BaseException; re-raised below
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        error = err
    found = save_failure(error) if error is not None else None
    mine = None if error is None else (D.rank(), found)
    failed = [x for x in D.gather_objects(mine) if x is not None]
    reasons = [(rank if reason[0] is None else reason[0], reason[1]) for rank, reason in failed
               if reason is not None]  # (rank it happened on, text)
    if reasons:
        rank, text = reasons[0]
        where = f" on rank {rank}" if D.world_size() > 1 else ""
        failure = SaveFailed(f"saving checkpoint {out} failed{where}: {text}; nothing of it was kept")
        failure.relayed_from_main = D.rank() != rank  # printed once, by the rank it happened on
        raise failure from None
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"saving checkpoint {out} failed on rank(s) {', '.join(str(r) for r, _ in failed)}")


def prune(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the last ``keep_last``, and incomplete ones older than the newest
    complete one (left by interrupted saves). Returns what was deleted."""
    complete = complete_checkpoints(run_dir)
    doomed = [path for _, path in complete[:-keep_last]]
    if complete:
        newest = complete[-1][0]
        root = Path(run_dir) / CHECKPOINTS_DIR
        for child in root.iterdir():
            m = _STEP_DIR.match(child.name.split(".")[0])
            if m and int(m.group(1)) < newest and not is_complete(child) and child.is_dir():
                doomed.append(child)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def load_rng(ckpt: str | os.PathLike, rank: int, cuda: bool | None = None) -> bool:
    """Restore this rank's RNG states from ``ckpt`` (the CUDA one when ``cuda``; None: ``cuda_present()``); False
    when the checkpoint has none for this rank (it was written by a run with fewer ranks)."""
    path = Path(ckpt) / RNG_DIR / f"rank{rank}.pt"
    if not path.is_file():
        return False
    restore_rng(torch.load(path, weights_only=False), cuda)
    return True
