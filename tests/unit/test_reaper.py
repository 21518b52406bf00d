"""tests/reaper.py: a test run killed with SIGKILL mid-way leaves no process behind, even ones that started sessions
of their own (as torchrun and the SGLang servers do) and one that rewrote its environment block with setproctitle (as
SGLang's scheduler and detokenizer do: its mark is gone from /proc/<pid>/environ)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

TESTS = Path(__file__).resolve().parents[1]
BOUND_S = 120.0
"""Generous bound on every wait (each takes well under a second once it happens)."""
INNER = '''
import os, subprocess, sys
from pathlib import Path

def test_starts_a_tree_of_its_own_sessions():
    titled = ("import os, pathlib, setproctitle, time; setproctitle.setproctitle('sglang::scheduler'); "
              "pathlib.Path(os.environ['PIDS_FILE'] + '.titled').touch(); time.sleep(600)")
    code = ("import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', {titled!r}], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(child.stdout.readline())
    Path(os.environ["PIDS_FILE"]).write_text(f"{os.getpid()} {child.pid} {grandchild}")
    child.wait()
'''


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_test_run_killed_with_sigkill_leaves_no_process_behind(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    pids_file = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PIDS_FILE": str(pids_file)}  # (the outer run's mark kept too)
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "reaper", "-p", "no:cacheprovider", "-n", "1", "-q",
                            "test_inner.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        _until(lambda: (pids_file.is_file() and len(pids_file.read_text().split()) == 3
                        and Path(f"{pids_file}.titled").is_file()) or run.poll() is not None,
               "the inner test did not start its processes")
        assert run.poll() is None, run.stdout.read().decode()[-3000:]
        tree = [psutil.Process(int(p)) for p in pids_file.read_text().split()]  # xdist worker, child, grandchild
        assert all(p.is_running() for p in tree)
        run.kill()  # pytest's main process, SIGKILL: nothing of pytest's own clean-up runs
        assert run.wait() == -signal.SIGKILL
        gone, alive = psutil.wait_procs(tree, timeout=BOUND_S)
        assert not alive, f"left behind: {[(p.pid, p.cmdline()[:3]) for p in alive]}"
    finally:
        run.kill()
        run.wait()
        for pid in (pids_file.read_text().split() if pids_file.is_file() else []):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
