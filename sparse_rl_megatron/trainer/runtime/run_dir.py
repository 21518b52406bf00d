"""A run directory belongs to one run at a time, and a re-run never loses what an earlier run wrote.

``RunDirLock``: an exclusive ``flock`` on ``<run_dir>/.lock``, which records the holder (pid, host, start time,
command). A second run into the same directory is refused with the holder's pid. The kernel drops the lock when
its holder dies (even by SIGKILL), so a lock file left by a dead run is taken over, and the takeover is said.

``archive_previous_outputs``: moves the outputs of an earlier, finished run into ``archive/<time>/`` before a new
run (that does not resume) writes its own.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Sequence

from sparse_rl_megatron.utils.errors import UserError

LOCK_FILE = ".lock"
ARCHIVE_DIR = "archive"


class RunDirBusy(UserError):
    """Another live process holds the run directory."""


class RunDirLock:
    """Hold ``run_dir`` for this process; ``with RunDirLock(d) as lock: ...`` (``lock.taken_over`` says whether a
    dead run's lock was replaced: its record, else None)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self.taken_over: dict | None = None

    def acquire(self) -> "RunDirLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}" if holder else "another process"
            since = f" since {holder['started']}" if holder and "started" in holder else ""
            raise RunDirBusy(
                f"run directory {self.run_dir} is in use by {who}{since}; wait for that run to end, stop it, or "
                "choose another run directory"
            ) from None
        previous = _read_record(fd)
        self.taken_over = previous or None
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the record (a clean exit leaves nothing to take over) and drop the lock."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_record(fd: int) -> dict:
    data = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not data:
        return {}
    try:
        record = json.loads(data)
    except json.JSONDecodeError:
        return {"pid": "?", "host": "?"}
    return record if isinstance(record, dict) else {}


def archive_previous_outputs(run_dir: str | os.PathLike, names: Sequence[str]) -> Path | None:
    """Move the entries ``names`` of ``run_dir`` that exist into ``run_dir/archive/<time>/``; returns that folder
    (None when there was nothing to move). Never overwrites an earlier archive."""
    run_dir = Path(run_dir)
    old = [run_dir / name for name in names if (run_dir / name).exists()]
    if not old:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = run_dir / ARCHIVE_DIR / stamp
    suffix = 1
    while dest.exists():
        dest = run_dir / ARCHIVE_DIR / f"{stamp}-{suffix}"
        suffix += 1
    dest.mkdir(parents=True)
    for path in old:
        path.rename(dest / path.name)
    return dest
