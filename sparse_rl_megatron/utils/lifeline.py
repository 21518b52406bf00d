"""A process started by a launcher ends when the launcher does, even when the launcher is killed with SIGKILL.

torchrun starts every rank in a session of its own, so when torchrun itself is killed (``kill -9``, the OOM
killer), nothing tells its ranks: they would train on as orphans, holding the run directory's lock and their
GPUs. ``end_with_parent()`` asks Linux to send this process SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``); the processes the rank started end in turn (SGLang's scheduler and detokenizer
set the same for themselves, the verifier workers and multiprocessing's helpers exit when their pipe to the
rank closes, megatron's file writers die with the saver: ``learner/save_children.py``).

``unignore_stop_signals()``: ``launch/torchrun.sh`` starts torchrun with SIGTERM and SIGINT ignored (it passes a stop
to the ranks itself, and torchrun's own handling would turn a clean stop into exit status 1); a rank inherits
that, so it puts the default actions back before anything else (``sparse-rl train`` then installs its own).

SIGKILL, not SIGTERM: a rank whose launcher is gone cannot finish a step cleanly anyway (the launcher hosts
the rendezvous store, and its other ranks are ending too), and the newest complete checkpoint stays intact
whatever the moment of death (saves are atomic). Linux only; elsewhere it does nothing and says so.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def under_torchrun() -> bool:
    """Whether this process is a worker started by torchrun (``torch.distributed.run``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def end_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits. Returns False where it cannot
    (not Linux). If the parent is already gone (it died before the call took effect), exits at once.

    The kernel ties the signal to the parent *thread* that forked this process; torchrun starts its workers
    from its main thread, which lives as long as torchrun."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # reparented between the two calls: the parent died first
        print(f"sparse-rl: the launcher of process {os.getpid()} is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    return True


def unignore_stop_signals() -> None:
    """SIGTERM and SIGINT back to their default actions where the launcher left them ignored."""
    for sig, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, default)
