"""One reaper for a whole test run: no process a test started outlives the run, even when pytest itself is killed
with SIGKILL (a CI time-out, ``timeout -s KILL``, the OOM killer).

Killed that way, pytest cannot clean up, and what its tests started (an ``sglang_ext.launch_server`` and its
scheduler, a ``launch/torchrun.sh`` run with both ranks and their reward workers) was seen alive minutes later with
parent 1, holding ports and CPU: torchrun and the servers start sessions of their own, so no process-group kill
reaches them, and an xdist worker finishes the test it is in before it notices its parent is gone.

``start(environ)``, in pytest's main process before any worker or test starts: marks the run's environment with
``SPARSE_RL_TEST_RUN=<token>`` (inherited by every process the run starts: xdist workers, subprocesses, torchrun
ranks, SGLang's spawned children) and starts this module as a process of its own session that waits for pytest's main
process to end (normally or killed): on a pidfd of it, and on the read end of a pipe whose write end that process
holds (a process forked from it without exec would hold it too; the pidfd does not wait for those). Then it SIGKILLs
every process whose environment carries the token, until a scan finds none. The environment is read from ``/proc/<pid>/environ`` (what a process was started with), so Linux only;
elsewhere ``start`` does nothing and says so.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

MARK = "SPARSE_RL_TEST_RUN"
"""The environment variable that marks every process of one test run."""
MAX_SCANS = 50
"""Scans of /proc before the reaper gives up on a process that keeps re-appearing (a fork between two scans)."""


def start(environ: dict[str, str] = os.environ) -> subprocess.Popen | None:
    """Mark ``environ`` with a fresh token and start the reaper for it; the returned process's stdin is the lifeline
    (keep the object: its pipe closes when this process ends). None where /proc is not there."""
    if not Path("/proc/self/environ").is_file():
        print("tests/reaper.py: no /proc: processes a killed test run started are not reaped", file=sys.stderr)
        return None
    token = uuid.uuid4().hex
    environ[MARK] = token
    env = {k: v for k, v in environ.items() if k != MARK}  # the reaper itself is not one of the run's processes
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), token, str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                            close_fds=True)


def pytest_configure(config) -> None:
    """In pytest's main process (not in an xdist worker): start the run's reaper (kept on ``config``, whose life is
    the process's). ``tests/conftest.py`` imports this hook; ``-p reaper`` loads it elsewhere."""
    if not hasattr(config, "workerinput"):
        config.sparse_rl_reaper = start()


def marked(token: str, skip: set[int]) -> list[int]:
    """The pids whose environment carries ``MARK=<token>`` (those not readable or gone are passed over)."""
    needle = f"{MARK}={token}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def parents() -> dict[int, int]:
    """``pid -> parent pid`` of every process (``/proc/<pid>/stat``; those gone meanwhile are passed over)."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # the name before ")" may hold spaces
            except (OSError, IndexError):
                continue
            out[int(entry.name)] = int(fields[1])
    return out


def with_descendants(pids: list[int], skip: set[int]) -> list[int]:
    """``pids`` and every process below one of them (not ``skip``)."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in found or pid in skip:
            continue
        found.add(pid)
        todo += children.get(pid, [])
    return sorted(found)


def reap(token: str) -> int:
    """SIGKILL every process of the run until none is left (or ``MAX_SCANS``); returns how many were killed."""
    killed: set[int] = set()
    for _ in range(MAX_SCANS):
        pids = with_descendants(marked(token, skip={os.getpid()}), skip={os.getpid()})
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
    return len(killed)


def wait_for_end(pid: int) -> None:
    """Until process ``pid`` has ended: its pidfd turns readable, or stdin (the pipe it holds) reaches EOF."""
    import select

    waits = [sys.stdin.fileno()]
    try:
        waits.append(os.pidfd_open(pid))
    except ProcessLookupError:
        return  # already gone
    except (AttributeError, OSError):
        pass  # no pidfd on this kernel: the pipe alone
    select.select(waits, [], [])


def main(token: str, pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the run is the run's; the reaper waits for its end
    wait_for_end(pid)
    reap(token)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
