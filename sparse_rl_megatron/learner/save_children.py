"""A checkpoint save killed with SIGKILL leaves no process behind, and a writer killed mid-save fails the save.

megatron-core's torch_dist save forks one writer process per file, and the first save in a process starts a
spawn ``Manager`` server (plus multiprocessing's resource tracker) just to carry the writers' results back.
None of them watches its parent: after a SIGKILL mid-save they would live on as orphans (the writers until
their files are written, the server and the tracker for good). The other way round, megatron's saver waits for
every writer to mark its task done (``JoinableQueue.join()``, no timeout): a writer killed before that (the OOM
killer, a ``kill -9``) left the save, and the run, waiting forever. ``children_die_with_us()`` wraps the save.
"""
from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import sys
import threading

from sparse_rl_megatron.utils.process_watch import describe_exit

_saver_pid: int | None = None  # this process's pid while save_checkpoint writes (forked children inherit it)
_fork_hook_lock = threading.Lock()
_fork_hook_installed = False
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
WRITER_POLL_S = 0.2
"""How often the watch looks at the writers' exit status during a save."""
_WRITER_KWARGS = ("local_proc_idx", "results_queue", "count_queue")
"""The arguments megatron hands each writer process (``write_preloaded_data_multiproc``): its index, the queue
its result goes to and the queue whose task it marks done."""


class WriterDied(RuntimeError):
    """A checkpoint writer process died before it reported its result (the message says which and how)."""

    TEXT = re.compile(r"checkpoint writer process \d+ died \([^)]*\) before it wrote its files")
    """Its message: what ``trainer.checkpointing.checkpoints.save_failure`` finds, also in a failure megatron
    gathered as text."""

    @classmethod
    def of(cls, pid: int, how: str) -> "WriterDied":
        """The failure of writer ``pid`` that ended ``how`` (``signal SIGKILL``, ...). (A classmethod, not an
        ``__init__``: the exception travels pickled through megatron's results queue, rebuilt from its message.)"""
        return cls(f"checkpoint writer process {pid} died ({how}) before it wrote its files")


def _die_with_parent() -> None:
    """Fork hook: a process forked by the saver during a save (megatron's per-file writers) is killed when the
    saver dies (Linux ``PR_SET_PDEATHSIG``)."""
    global _saver_pid
    saver, _saver_pid = _saver_pid, None  # this child's own children are not the saver's
    if saver is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != saver:  # the saver died before the line above took effect
        os._exit(1)


class _RecordingContext:
    """A multiprocessing context whose ``Process`` also records each process with megatron's writer arguments
    (multiprocessing drops a process's arguments once it is started); everything else is the real one."""

    def __init__(self, real, writers: list):
        self._real, self._writers = real, writers

    def __getattr__(self, name):
        return getattr(self._real, name)

    def Process(self, *args, **kwargs):  # noqa: N802 - multiprocessing's name
        child = self._real.Process(*args, **kwargs)
        given = kwargs.get("kwargs") or {}
        if all(k in given for k in _WRITER_KWARGS):
            self._writers.append((child, {k: given[k] for k in _WRITER_KWARGS}))
        return child


class _RecordingMultiprocessing:
    """What megatron's writer module sees as ``mp`` during a save: the real module, with recording contexts."""

    def __init__(self, real, writers: list):
        self._real, self._writers = real, writers

    def __getattr__(self, name):
        return getattr(self._real, name)

    def get_context(self, method=None):
        return _RecordingContext(self._real.get_context(method), self._writers)


def _unfinished(count_queue) -> int:
    """Tasks of megatron's count queue not yet marked done (one per writer that has not reported)."""
    return count_queue._unfinished_tasks._semlock._get_value()


def _report_dead_writers(writers: list, stop: threading.Event) -> None:
    """Until ``stop``: when a recorded writer exited with a non-zero status before it marked its task done, report
    a ``WriterDied`` in its place and mark the task done, so megatron's saver stops waiting and fails the save
    through its own error path (gathered on every rank). A writer has not marked its task done when the count
    queue has more unfinished tasks than writers still running (one writer, one task; a running writer may have
    marked its own already, so this never takes a live writer's task, and waits a poll for it to exit). A writer
    that died after marking its task done had reported its result: nothing is added, the save goes on."""
    handled: set[int] = set()
    while not stop.wait(WRITER_POLL_S):
        for child, args in list(writers):
            if id(child) in handled or child._popen is None:
                continue
            code = child.exitcode
            if code is None:
                continue
            if code == 0:
                handled.add(id(child))
                continue
            count_queue = args["count_queue"]
            running = sum(1 for c, a in writers if a["count_queue"] is count_queue and c.exitcode is None)
            if _unfinished(count_queue) <= running:  # it may have marked its task done before it died
                if running == 0:  # it did: every task is done
                    handled.add(id(child))
                continue  # else a running writer may yet mark its own: look again at the next poll
            handled.add(id(child))
            args["results_queue"].put((args["local_proc_idx"], WriterDied.of(child.pid, describe_exit(code))))
            count_queue.task_done()


@contextlib.contextmanager
def children_die_with_us():
    """Around megatron's ``dist_checkpointing.save``: processes forked meanwhile (the writers) die with this one
    (``PR_SET_PDEATHSIG``, Linux), a writer that dies first fails the save (``WriterDied``) instead of leaving it
    waiting, and megatron's results queue is a plain in-process queue instead of a Manager server (a synchronous
    save puts and gets the results in this very process)."""
    global _fork_hook_installed, _saver_pid
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with _fork_hook_lock:
        if not _fork_hook_installed:
            os.register_at_fork(after_in_child=_die_with_parent)
            _fork_hook_installed = True
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    if isinstance(filesystem_async.mp, _RecordingMultiprocessing):
        raise RuntimeError("a checkpoint save is already in progress in this process (saves do not overlap)")
    writers: list = []
    stop = threading.Event()
    watch = threading.Thread(target=_report_dead_writers, args=(writers, stop), name="checkpoint-writer-watch",
                             daemon=True)
    real_mp = filesystem_async.mp
    try:
        filesystem_async.mp = _RecordingMultiprocessing(real_mp, writers)
        _saver_pid = os.getpid()
        watch.start()
        yield
    finally:
        _saver_pid = None
        filesystem_async.mp = real_mp
        stop.set()
        if watch.ident is not None:
            watch.join()
