"""The in-process SGLang engine's launch-phase SIGQUIT handler: a child of the engine that failed makes it stop
only the engine's processes and raise; a SIGQUIT while every engine process lives (a stale report from an earlier
engine's watchdog thread) is ignored."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from sparse_rl_megatron.rollout import sglang_client
from sparse_rl_megatron.rollout.sglang_client import ChildFailedHandler, EngineProcessFailed

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def _sigquit_with(handler) -> None:
    previous = signal.signal(signal.SIGQUIT, handler)
    try:
        os.kill(os.getpid(), signal.SIGQUIT)  # what SGLang's children (and its watchdog threads) do
    finally:
        signal.signal(signal.SIGQUIT, previous)


def test_a_failing_child_raises_and_stops_only_the_engines_processes():
    earlier = subprocess.Popen(SLEEP)  # e.g. a checkpoint writer started before the engine
    try:
        handler = ChildFailedHandler()
        engine_child = subprocess.Popen(SLEEP)
        failed_child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])  # the scheduler that failed
        with pytest.raises(EngineProcessFailed, match=r"failed while starting.*engine process"):
            _sigquit_with(handler)
        assert engine_child.wait(timeout=10) == -signal.SIGKILL
        assert earlier.poll() is None
        failed_child.wait(timeout=10)
    finally:
        earlier.kill()
        earlier.wait()


def test_a_sigquit_while_every_engine_process_lives_is_ignored(monkeypatch, capsys):
    monkeypatch.setattr(sglang_client, "FAILED_CHILD_WAIT_S", 0.2)
    handler = ChildFailedHandler()
    engine_child = subprocess.Popen(SLEEP)
    try:
        _sigquit_with(handler)  # no raise
        assert engine_child.poll() is None
        assert "ignored a SIGQUIT while the SGLang engine starts" in capsys.readouterr().err
    finally:
        engine_child.kill()
        engine_child.wait()
