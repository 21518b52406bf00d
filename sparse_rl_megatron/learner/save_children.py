"""A checkpoint save killed with SIGKILL leaves no process behind.

megatron-core's torch_dist save forks one writer process per file, and the first save in a process starts a
spawn ``Manager`` server (plus multiprocessing's resource tracker) just to carry the writers' results back.
None of them watches its parent: after a SIGKILL mid-save they would live on as orphans (the writers until
their files are written, the server and the tracker for good). ``children_die_with_us()`` wraps the save.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading

_saver_pid: int | None = None  # this process's pid while save_checkpoint writes (forked children inherit it)
_fork_hook_lock = threading.Lock()
_fork_hook_installed = False
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


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


@contextlib.contextmanager
def children_die_with_us():
    """Around megatron's ``dist_checkpointing.save``: processes forked meanwhile (the writers) die with this one
    (``PR_SET_PDEATHSIG``, Linux), and megatron's results queue is a plain in-process queue instead of a Manager
    server (a synchronous save puts and gets the results in this very process)."""
    global _fork_hook_installed, _saver_pid
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with _fork_hook_lock:
        if not _fork_hook_installed:
            os.register_at_fork(after_in_child=_die_with_parent)
            _fork_hook_installed = True
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    _saver_pid = os.getpid()
    try:
        yield
    finally:
        _saver_pid = None
