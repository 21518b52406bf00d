"""Is a training checkpoint intact? Checked on its files before anything is loaded from it.

``save`` (``checkpoints.py``) records in ``trainer_state.json``, which it writes last, the size of every other
file of the checkpoint (``files``: path relative to the checkpoint -> bytes). ``problem(ckpt)`` says in a few
words what is wrong, or None when intact: no (or an unreadable) ``trainer_state.json``, a recorded file missing,
of another size (truncated) or unreadable (its first and last bytes are read). Checkpoints written before sizes
were recorded are checked for their state and learner metadata files only. Whether the checkpoint fits the
run's model (architecture, tensor shapes) is checked when it is loaded (``resume.py``).

Sizes, not checksums: hashing a 7B run's optimizer state (~100 GB) would add minutes to every save and resume;
a size catches the damage a crash, a full disk or an interrupted copy leaves (a short or missing file), not a
flipped bit inside a file of the right size.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from sparse_rl_megatron.utils.file_checks import MEGATRON_META_FILE as LEARNER_META

STATE_FILE = "trainer_state.json"
"""The trainer's state in a checkpoint directory; written last, so a checkpoint without it is incomplete."""
READ_PROBE_BYTES = 4096
"""Bytes read at the start and at the end of each recorded file: it is there and the disk gives it back."""


def file_sizes(ckpt: str | os.PathLike) -> dict[str, int]:
    """``relative path -> size`` of every file under ``ckpt`` except the trainer state (what ``save`` records)."""
    root = Path(ckpt)
    sizes = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != STATE_FILE and not path.name.endswith(".tmp"):
            sizes[path.relative_to(root).as_posix()] = path.stat().st_size
    return sizes


def _readable(path: Path, size: int) -> str | None:
    try:
        with open(path, "rb") as f:
            f.read(READ_PROBE_BYTES)
            if size > READ_PROBE_BYTES:
                f.seek(size - READ_PROBE_BYTES)
                if len(f.read(READ_PROBE_BYTES)) != READ_PROBE_BYTES:
                    return "ends early"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return None


def read_state_file(ckpt: str | os.PathLike) -> tuple[dict | None, str | None]:
    """``(trainer state, None)``, or ``(None, what is wrong with it)``."""
    path = Path(ckpt) / STATE_FILE
    if not path.is_file():
        return None, f"it is incomplete (no {STATE_FILE}: its save was interrupted, or the file was removed)"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, f"its {STATE_FILE} cannot be read ({err})"
    if not isinstance(state, dict) or "step" not in state:
        return None, f"its {STATE_FILE} is not a trainer state"
    return state, None


def problem(ckpt: str | os.PathLike, format_version: int) -> str | None:
    """What makes ``ckpt`` unusable, in a few words (None: intact)."""
    root = Path(ckpt)
    state, wrong = read_state_file(root)
    if wrong:
        return wrong
    if state.get("format_version") != format_version:
        return f"its {STATE_FILE} has format_version {state.get('format_version')}, this version reads {format_version}"
    recorded = state.get("files")
    if recorded is None:  # written before sizes were recorded
        return None if (root / LEARNER_META).is_file() else f"{LEARNER_META} is missing"
    for rel, size in sorted(recorded.items()):
        path = root / rel
        if not path.is_file():
            return f"{rel} is missing"
        actual = path.stat().st_size
        if actual != size:
            how = "truncated" if actual < size else "it was changed"
            return f"{rel} has {actual} bytes, {size} were saved ({how})"
        unreadable = _readable(path, size)
        if unreadable:
            return f"{rel} {unreadable}"
    return None
