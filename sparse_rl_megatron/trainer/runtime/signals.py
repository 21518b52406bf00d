"""Stop requests: SIGTERM, SIGUSR1 (Slurm's time-limit warning), SIGINT (Ctrl-C), or a ``STOP`` file.

A request only sets a flag; the loop looks at it at each step boundary, agrees on it across ranks (any rank's
request stops every rank), saves a checkpoint and exits 0. A second Ctrl-C aborts at once (KeyboardInterrupt);
the last saved checkpoint is still complete. The ``STOP`` file in the run directory is for launchers that
cannot signal the training processes themselves (an sbatch script traps USR1 and writes it; see launch/).
"""
from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path
from types import FrameType

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
STOP_FILE = "STOP"
_SEEN: dict[str, str] = {}
"""The first stop signal of this process: ``early`` until a ``StopRequest`` takes it over, ``stop`` after."""


@contextlib.contextmanager
def early_stops_noted():
    """Around a command: until the run installs its ``StopRequest``, a stop signal is noted (and honoured once
    the run is set up: "stopped by SIGTERM before step 1") instead of killing the process. Once a stop was
    requested, later stop signals are ignored to the end of the process too (a launcher repeats its request, or
    one arrives while the stopped run exits): the process is ending as asked, not killed half-way out."""
    def note(signum: int, frame: FrameType | None) -> None:
        _SEEN.setdefault("early", signal.Signals(signum).name)

    _SEEN.clear()
    previous = {getattr(signal, name): signal.signal(getattr(signal, name), note) for name in STOP_SIGNALS}
    try:
        yield
    finally:
        stopped = bool(_SEEN)
        _SEEN.clear()
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if stopped else handler)


class StopRequest:
    """Installed for the life of a run: ``with StopRequest(run_dir) as stop: ... stop.reason``."""

    def __init__(self, run_dir: str | Path, announce: bool = True):
        self.stop_file = Path(run_dir) / STOP_FILE
        self.announce = announce
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # second Ctrl-C: abort now
        if self.signal_name is None:
            self.signal_name = name
            _SEEN.setdefault("stop", name)
            if self.announce:
                again = " (Ctrl-C again to abort without saving)" if name == "SIGINT" else ""
                print(f"\n{name} received: stopping at the end of the current step, after a checkpoint{again}",
                      file=sys.stderr, flush=True)

    @property
    def reason(self) -> str | None:
        """What asked this rank to stop (a signal name or the STOP file), else None."""
        if self.signal_name is not None:
            return self.signal_name
        if self.stop_file.exists():
            return f"{STOP_FILE} file"
        return None

    def clear_stop_file(self) -> None:
        """Remove a STOP file left for an earlier process of the run (a new process starts un-stopped)."""
        self.stop_file.unlink(missing_ok=True)

    def __enter__(self) -> "StopRequest":
        for name in STOP_SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)
        early = _SEEN.pop("early", None)
        if early is not None:  # arrived while the command started (early_stops_noted)
            self._handle(getattr(signal, early), None)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
