"""A pool of verifier worker processes with a per-answer time limit.

Why processes: math-verify (sympy) can run for minutes on a pathological answer (``9^{9^{9^9}}``,
``(x+1)^{2000}``, 300 nested parentheses), and its own ``signal.alarm`` timeouts only work in a main
thread. Each worker is a long-lived process (math-verify's import costs ~1 s, paid once per worker) that
receives one task at a time over its own pipe. Two clocks guard each answer:
- soft: inside the worker, an interval timer raises at ``timeout_s``; the worker answers ``timeout`` and
  stays alive (nothing to restart);
- hard: the parent kills a worker that has not answered ``_KILL_GRACE_S`` later (stuck in C code, where
  Python signal handlers never run, or in a bare ``except:``), records ``timeout`` and starts a
  replacement. Other workers keep going meanwhile; a hung worker is never waited on.
A worker that dies (crash, OOM kill) yields ``parse_error`` for its task and is replaced.

Workers start through a ``forkserver`` that has already imported math-verify, so a replacement costs a
fork rather than a fresh interpreter, and the parent's threads (torch, tokenizers) are never forked.
"""
from __future__ import annotations

import logging
import multiprocessing
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing import connection
from typing import Literal, Sequence, get_args

from sparse_rl_megatron.rewards.extract import ANSWER_STYLES
from sparse_rl_megatron.rewards.verify import Verdict
from sparse_rl_megatron.rewards.worker import safe_extract, worker_main

log = logging.getLogger(__name__)

StartMethod = Literal["forkserver", "spawn", "fork"]
START_METHODS: tuple[str, ...] = get_args(StartMethod)

# After the in-worker (soft) timer fires, the worker has this long to send its 'timeout' verdict before
# the parent kills it: enough for a Python-level unwind, short enough that a stuck worker costs little.
_KILL_GRACE_S = 1.0
# A fresh worker imports math-verify/sympy (~1 s alone, several seconds on a loaded 2-core machine);
# one that is not ready after this long is broken (bad environment), not slow.
_WORKER_START_TIMEOUT_S = 120.0
# Modules the forkserver imports once, so every worker forked from it starts with them loaded.
_PRELOAD = ["sparse_rl_megatron.rewards.worker", "math_verify", "sympy"]


@dataclass
class VerifierPoolConfig:
    """How answers are verified: processes, time and memory per answer."""

    num_workers: int = 2
    """Worker processes (each checks one answer at a time)."""
    timeout_s: float = 5.0
    """Time limit per answer (extraction + parsing + equivalence); past it the verdict is ``timeout``."""
    soft_timeout: bool = True
    """Also time out inside the worker (cheap: no restart). Off: only the parent's kill enforces the limit."""
    memory_limit_gb: float | None = 4.0
    """Address-space cap of each worker (None = none), so one huge answer cannot eat the machine's RAM."""
    start_method: StartMethod = "forkserver"
    """How workers start: ``forkserver`` (preloaded math-verify, fast restarts), ``spawn`` or ``fork``."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"VerifierPoolConfig.num_workers must be >= 1, got {self.num_workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"VerifierPoolConfig.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise ValueError(
                f"VerifierPoolConfig.memory_limit_gb must be > 0 or None (no cap), got {self.memory_limit_gb}"
            )
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"VerifierPoolConfig.start_method must be one of {', '.join(START_METHODS)}, "
                f"got '{self.start_method}'"
            )


class _Worker:
    def __init__(self, ctx, config: VerifierPoolConfig):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        soft = config.timeout_s if config.soft_timeout else None
        mem = int(config.memory_limit_gb * 2**30) if config.memory_limit_gb else None
        self.process = ctx.Process(target=worker_main, args=(child_conn, soft, mem), daemon=True,
                                   name="sparse-rl-verifier")
        self.process.start()
        child_conn.close()
        self.conn = parent_conn
        self.ready = False
        self.started_at = time.monotonic()
        self.task: int | None = None
        self.deadline = float("inf")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    for w in workers:
        w.process.join(timeout=2)
        w.kill()
    workers.clear()


class _Lanes:
    """Pending task ids in one lane per worker slot, chosen by the gold answer.

    The samples of a GRPO group share their gold answer; sending them to the same worker lets its gold
    cache (``verify._parse_gold``) parse that gold once instead of once per worker. A worker whose lane is
    empty takes from the longest other lane, so no worker idles while work is pending.
    """

    def __init__(self, num_lanes: int):
        self.lanes = [deque() for _ in range(num_lanes)]
        self.size = 0

    def __bool__(self) -> bool:
        return self.size > 0

    def push(self, task: int, gold: str) -> None:
        self.lanes[hash(gold) % len(self.lanes)].append(task)
        self.size += 1

    def push_front(self, task: int, slot: int) -> None:
        self.lanes[slot % len(self.lanes)].appendleft(task)
        self.size += 1

    def pop(self, slot: int) -> int:
        self.size -= 1
        lane = self.lanes[slot % len(self.lanes)]
        if lane:
            return lane.popleft()
        return max(self.lanes, key=len).pop()  # steal from the far end: the owner keeps its nearby golds


class VerifierPool:
    """Checks (response, gold, style) triples in worker processes; ``check`` returns one ``Verdict`` each.

    Use as a context manager or call ``close()``. Thread-safe: concurrent ``check`` calls run one at a time.
    Counters: ``timeouts`` (answers past the limit), ``restarts`` (workers killed or dead and replaced).
    """

    def __init__(self, config: VerifierPoolConfig | None = None):
        self.config = config or VerifierPoolConfig()
        self._ctx = multiprocessing.get_context(self.config.start_method)
        if self.config.start_method == "forkserver":
            self._ctx.set_forkserver_preload(_PRELOAD)  # no effect if this process's forkserver already runs
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self.timeouts = 0
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> "VerifierPool":
        """Start the workers now (they also start on the first ``check``) and wait until they are ready."""
        with self._lock:
            self._fill()
            self._wait_ready(lambda: all(w.ready for w in self._workers))
        return self

    def close(self) -> None:
        """Stop the workers (idempotent). A later ``check`` starts new ones."""
        with self._lock:
            _shutdown(self._workers)

    def __enter__(self) -> "VerifierPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def busy_worker_pids(self) -> list[int]:
        """Process ids of the workers checking an answer right now (for monitoring and tests)."""
        return [w.process.pid for w in list(self._workers) if w.task is not None]

    def _fill(self) -> None:
        while len(self._workers) < self.config.num_workers:
            self._workers.append(_Worker(self._ctx, self.config))

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)
        self.restarts += 1
        self._fill()

    def _wait_ready(self, done) -> None:
        while not done():
            starting = [w for w in self._workers if not w.ready]
            for conn in connection.wait([w.conn for w in starting], timeout=1.0):
                self._on_message(next(w for w in starting if w.conn is conn), None)
            self._check_start_timeouts()

    def _check_start_timeouts(self) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready and now - w.started_at > _WORKER_START_TIMEOUT_S:
                w.kill()
                self._workers.remove(w)
                raise RuntimeError(
                    f"a verifier worker did not start within {_WORKER_START_TIMEOUT_S:.0f} s "
                    f"(exit code {w.process.exitcode}); check that math-verify imports in this environment"
                )

    def _on_message(self, worker: _Worker, results: list | None) -> None:
        """Handle one message (or EOF) from ``worker``."""
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.process.exitcode
            if not worker.ready:
                self._workers.remove(worker)
                worker.kill()
                raise RuntimeError(f"a verifier worker exited while starting (exit code {code}); "
                                   "check that math-verify imports in this environment") from None
            if worker.task is not None and results is not None:
                results[worker.task] = Verdict(0.0, "parse_error", None,
                                               f"verifier worker died while checking (exit code {code})")
                log.warning("verifier worker %s died (exit code %s); replacing it", worker.process.pid, code)
            self._replace(worker)
            return
        if msg[0] == "ready":
            worker.ready = True
            return
        task_id, fields = msg
        if results is not None and task_id == worker.task:
            results[task_id] = Verdict(*fields)
            if results[task_id].reason == "timeout":
                self.timeouts += 1
        worker.task = None
        worker.deadline = float("inf")

    # -- work ------------------------------------------------------------------------------------------
    def check(self, tasks: Sequence[tuple[str, str, str]]) -> list[Verdict]:
        """Verdicts for ``(response, gold, style)`` triples, in order. Never raises for a bad answer."""
        for i, task in enumerate(tasks):
            if len(task) != 3 or task[2] not in ANSWER_STYLES:
                raise ValueError(f"task {i}: expected (response, gold, style) with style one of "
                                 f"{', '.join(ANSWER_STYLES)}, got {str(task)[:200]}")
        results: list[Verdict | None] = [None] * len(tasks)
        pending = _Lanes(self.config.num_workers)
        for i, (_, gold, _) in enumerate(tasks):
            pending.push(i, str(gold))
        hard_limit = self.config.timeout_s + (_KILL_GRACE_S if self.config.soft_timeout else 0.0)
        with self._lock:
            try:
                self._run(tasks, results, pending, hard_limit)
            except BaseException:
                # Interrupted mid-batch: a busy worker would later answer a task of this batch into the
                # next batch's slots. Replace every busy worker before letting the exception through.
                for w in [w for w in self._workers if w.task is not None]:
                    self._replace(w)
                raise
        return results  # type: ignore[return-value]

    def _run(self, tasks, results, pending, hard_limit) -> None:
        self._fill()
        while pending or any(w.task is not None for w in self._workers):
            for slot, w in enumerate(self._workers):
                if w.ready and w.task is None and pending:
                    i = pending.pop(slot)
                    response, gold, style = tasks[i]
                    w.task, w.deadline = i, time.monotonic() + hard_limit
                    try:
                        w.conn.send((i, str(response), str(gold), style))
                    except (OSError, ValueError):  # the worker died while idle: retry the task elsewhere
                        pending.push_front(i, slot)
                        w.task = None
                        log.warning("verifier worker %s is gone; replacing it", w.process.pid)
                        self._replace(w)
                        break  # self._workers changed
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            next_deadline = min((w.deadline for w in waiting), default=float("inf"))
            wait_s = min(max(0.0, next_deadline - time.monotonic()), 1.0)
            for conn in connection.wait([w.conn for w in waiting], timeout=wait_s):
                worker = next((w for w in self._workers if w.conn is conn), None)
                if worker is not None:
                    self._on_message(worker, results)
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now >= w.deadline:
                    response, _, style = tasks[w.task]
                    results[w.task] = Verdict(0.0, "timeout", safe_extract(str(response), style),
                                              f"worker killed after {hard_limit:g} s without a verdict")
                    self.timeouts += 1
                    log.warning("verifier worker %s hung past %.1f s; killing and replacing it",
                                w.process.pid, hard_limit)
                    self._replace(w)
            self._check_start_timeouts()
