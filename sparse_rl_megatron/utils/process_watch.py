"""Watch the child processes a component cannot work without, so that their death fails its calls at once.

An in-process SGLang engine runs its scheduler(s) and detokenizer as child processes. When one dies (killed,
out of memory, a crash), a call waiting for its answer would wait forever, or SGLang's own watchdog would kill
the whole process tree, the trainer included, without a word of ours. ``ProcessWatch`` turns the death into a
``ProcessDied`` error naming the process, its pid and its exit code or signal, raised by the call that was
waiting, within a fraction of a second:

    watch = ProcessWatch("the SGLang engine", [("scheduler_0", proc), ("detokenizer", proc2)])
    watch.check()                                        # raises ProcessDied if one has exited
    result = loop.run_until_complete(watch.guard(coro))  # coro's result, or ProcessDied as soon as one exits
    died = watch.wait(timeout_s)                         # block until one exits (None on timeout)

A watched process is a ``multiprocessing.Process`` child of this process, or any object with ``pid``,
``sentinel`` (a file descriptor readable once the process has exited) and ``exitcode``. ``guard`` waits on the
sentinels in the event loop itself (no polling, no thread). Any exit counts, code 0 included: these processes
serve until they are told to stop, and SGLang's scheduler exits 0 after logging an error it caught.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
from multiprocessing.connection import wait as wait_fds
from typing import Any, Sequence

from sparse_rl_megatron.utils.errors import RunFailed

REAP_WAIT_S = 2.0
"""How long to wait for the exit status of a process whose sentinel says it is gone (the kernel closes its files
a moment before it becomes a zombie)."""
CANCEL_WAIT_S = 2.0
"""How long a guarded call whose process died may take to unwind after it is cancelled."""


def describe_exit(code: int | None) -> str:
    """``exit code 1``, ``signal SIGKILL``, ... for a ``multiprocessing`` exit code (negative: the signal)."""
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class ProcessDied(RunFailed):
    """A watched process exited; the message is one line (owner, process name, pid, exit code or signal)."""

    def __init__(self, owner: str, name: str, pid: int | None, exitcode: int | None):
        self.owner, self.name, self.pid, self.exitcode = owner, name, pid, exitcode
        how = f"was killed by {describe_exit(exitcode)}" if exitcode is not None and exitcode < 0 else (
            f"exited with {describe_exit(exitcode)}" if exitcode else
            f"exited with {describe_exit(exitcode)} (if it hit an error, its log is above)")
        super().__init__(f"{owner}'s process {name} (pid {pid}) {how}")

    def __reduce__(self):  # picklable, so it can be handed to other ranks as it is
        return ProcessDied, (self.owner, self.name, self.pid, self.exitcode)


class ProcessWatch:
    """The named processes ``owner`` needs (see the module docstring)."""

    def __init__(self, owner: str, processes: Sequence[tuple[str, Any]]):
        if not processes:
            raise ValueError(f"ProcessWatch: {owner} has no process to watch")
        self.owner = owner
        self.processes = list(processes)

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.processes}

    def _exited(self) -> list[tuple[str, Any]]:
        ready = set(wait_fds([proc.sentinel for _, proc in self.processes], timeout=0))
        return [(name, proc) for name, proc in self.processes if proc.sentinel in ready]

    def _failure(self, exited: list[tuple[str, Any]]) -> ProcessDied:
        name, proc = exited[0]
        if hasattr(proc, "join"):
            with contextlib.suppress(Exception):
                proc.join(timeout=REAP_WAIT_S)
        return ProcessDied(self.owner, name, proc.pid, proc.exitcode)

    def dead(self) -> ProcessDied | None:
        """The error of the first watched process that has exited, else None (never blocks)."""
        exited = self._exited()
        return self._failure(exited) if exited else None

    def check(self) -> None:
        """Raise ``ProcessDied`` if a watched process has exited."""
        failure = self.dead()
        if failure is not None:
            raise failure

    def wait(self, timeout_s: float | None) -> ProcessDied | None:
        """Block until a watched process exits (its error), or ``timeout_s`` passes (None)."""
        ready = wait_fds([proc.sentinel for _, proc in self.processes], timeout=timeout_s)
        return self._failure([(n, p) for n, p in self.processes if p.sentinel in ready]) if ready else None

    async def guard(self, awaitable):
        """Await ``awaitable`` in the running loop; if a watched process exits first, cancel it and raise
        ``ProcessDied``. (The loop watches the processes' sentinels while it waits.)"""
        failure = self.dead()
        if failure is not None:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never started: nothing to unwind
            raise failure
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(awaitable)
        gone = loop.create_future()
        fds = [proc.sentinel for _, proc in self.processes]

        def on_exit() -> None:
            if not gone.done():
                gone.set_result(None)

        for fd in fds:
            loop.add_reader(fd, on_exit)
        try:
            await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fd in fds:
                loop.remove_reader(fd)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait([task], timeout=CANCEL_WAIT_S)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: the process's death is the error to report, not what it caused
        raise self._failure(self._exited() or self.processes[:1])
