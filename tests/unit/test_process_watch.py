"""Process lifetimes: ``ProcessWatch`` turns a child's death into one line raised by the call that waits on it,
and ``end_with_parent`` ends a process with its parent (SIGKILL included), with real child processes."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sparse_rl_megatron.utils.errors import RunFailed
from sparse_rl_megatron.utils.process_watch import ProcessDied, ProcessWatch, describe_exit

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 30.0
"""Generous bound on anything the tests wait for (the events themselves take milliseconds)."""


def _serve(orders, code: int = 0) -> None:
    orders.recv()  # a server that runs until told to stop (or killed), then exits with ``code``
    sys.exit(code)


@pytest.fixture
def ctx():
    return mp.get_context("fork")


class Release:
    """Tells the ``_serve`` children to stop (a pipe: a killed child holds no lock the others need)."""

    def __init__(self, ctx):
        self.orders, self._send = ctx.Pipe(duplex=False)

    def set(self) -> None:
        for _ in range(4):
            self._send.send(None)


def test_a_call_returns_while_the_processes_live(ctx):
    release = Release(ctx)
    proc = ctx.Process(target=_serve, args=(release.orders,))
    proc.start()
    try:
        watch = ProcessWatch("the engine", [("scheduler_0", proc)])

        async def answer():
            await asyncio.sleep(0)
            return 42

        assert asyncio.run(watch.guard(answer())) == 42
        watch.check()
        assert watch.dead() is None and watch.pids == {"scheduler_0": proc.pid}
    finally:
        release.set()
        proc.join(BOUND_S)


def test_a_process_killed_while_a_call_waits_fails_the_call_in_one_line(ctx):
    release = Release(ctx)
    procs = [ctx.Process(target=_serve, args=(release.orders,)) for _ in range(2)]
    for p in procs:
        p.start()
    watch = ProcessWatch("the SGLang engine", [("scheduler_0", procs[0]), ("detokenizer", procs[1])])

    async def call_that_never_answers():
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, os.kill, procs[0].pid, signal.SIGKILL)  # dies while the call waits
        await loop.create_future()

    t0 = time.monotonic()
    try:
        with pytest.raises(ProcessDied) as err:
            asyncio.run(asyncio.wait_for(watch.guard(call_that_never_answers()), BOUND_S))
    finally:
        release.set()
        for p in procs:
            p.join(BOUND_S)
    assert time.monotonic() - t0 < BOUND_S  # raised by the death, not by the bound
    pid = procs[0].pid
    assert str(err.value) == f"the SGLang engine's process scheduler_0 (pid {pid}) was killed by signal SIGKILL"
    assert isinstance(err.value, RunFailed) and err.value.exit_code == 1 and "\n" not in str(err.value)
    with pytest.raises(ProcessDied, match="scheduler_0"):
        watch.check()  # and every later call fails at once


def test_an_exit_is_named_with_its_code_and_waited_for(ctx):
    release, crash = Release(ctx), Release(ctx)
    server = ctx.Process(target=_serve, args=(release.orders,))
    crasher = ctx.Process(target=_serve, args=(crash.orders, 3))
    server.start()
    crasher.start()
    watch = ProcessWatch("the engine", [("scheduler_0", server), ("detokenizer", crasher)])
    try:
        assert watch.wait(0) is None  # nothing has exited yet
        crash.set()
        died = watch.wait(BOUND_S)
        assert died is not None
        assert str(died) == f"the engine's process detokenizer (pid {crasher.pid}) exited with exit code 3"
    finally:
        release.set()
        server.join(BOUND_S)
    assert describe_exit(-15) == "signal SIGTERM" and describe_exit(0) == "exit code 0"


_PARENT = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
    print(child.pid, flush=True)
    child.wait()
""")
_CHILD = textwrap.dedent("""
    import sys
    from sparse_rl_megatron.utils.lifeline import end_with_parent
    assert end_with_parent()
    print("armed", flush=True)
    sys.stdin.read()  # runs until its stdin closes (it never does: the parent's death must end it)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_process_in_its_own_session_ends_with_its_killed_parent(tmp_path):
    import psutil

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp_path / "child.log"
    with open(log, "w") as out:
        parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD], stdout=subprocess.PIPE, stderr=out,
                                  stdin=subprocess.PIPE, text=True, env=env)
    # the parent prints the child's pid, the child "armed" once its lifeline is set: on one pipe, in either order
    lines = sorted(parent.stdout.readline().strip() for _ in range(2))
    assert lines[1] == "armed" and lines[0].isdigit(), (lines, log.read_text())
    child = psutil.Process(int(lines[0]))
    try:
        assert child.is_running()
        parent.kill()  # SIGKILL: no chance to pass anything on
        parent.wait()
        child.wait(timeout=BOUND_S)  # psutil.TimeoutExpired (the test fails) if the child outlives its parent
    finally:
        if child.is_running():
            child.kill()


def test_an_engine_start_that_raises_takes_the_children_it_started_along():
    """``children_killed_if_it_raises`` (around ``sglang.Engine(...)``): interrupted while its children start, the
    children started inside the block and theirs are killed; a child from before the block and multiprocessing's
    resource tracker are left alone; a block that does not raise kills nothing."""
    import psutil

    from multiprocessing import resource_tracker

    from sparse_rl_megatron.rollout.sglang_client import children_killed_if_it_raises

    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    parent_of_one = [sys.executable, "-c", "import subprocess, sys, time; "
                     f"subprocess.Popen({sleeper!r}); print('started', flush=True); time.sleep(300)"]
    old = subprocess.Popen(sleeper)
    kept, started = None, []
    try:
        with children_killed_if_it_raises():
            kept = subprocess.Popen(sleeper)
        with pytest.raises(KeyboardInterrupt):
            with children_killed_if_it_raises():
                scheduler = subprocess.Popen(parent_of_one, stdout=subprocess.PIPE, text=True)
                assert scheduler.stdout.readline().strip() == "started"
                started = [psutil.Process(scheduler.pid), *psutil.Process(scheduler.pid).children()]
                assert len(started) == 2
                resource_tracker.ensure_running()  # multiprocessing's shared helper, maybe started here: kept
                raise KeyboardInterrupt
        _, alive = psutil.wait_procs(started, timeout=BOUND_S)  # both would sleep 300 s
        assert not alive and old.poll() is None and kept.poll() is None
        assert psutil.Process(resource_tracker._resource_tracker._pid).is_running()
    finally:
        for proc in started:  # left alive only if the code under test failed
            if proc.is_running():
                proc.kill()
        for proc in (old, kept):
            if proc is not None:
                proc.kill()
                proc.wait()
