"""The in-process SGLang engine's launch-phase SIGQUIT handler stops only the engine's processes and raises."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from sparse_rl_megatron.rollout.sglang_client import ChildFailedHandler, EngineProcessFailed


def test_a_failing_child_raises_and_stops_only_the_engines_processes():
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    earlier = subprocess.Popen(sleep)  # e.g. a checkpoint writer started before the engine
    try:
        handler = ChildFailedHandler()
        engine_child = subprocess.Popen(sleep)
        previous = signal.signal(signal.SIGQUIT, handler)
        try:
            with pytest.raises(EngineProcessFailed, match=r"failed while starting.*1 engine process"):
                os.kill(os.getpid(), signal.SIGQUIT)  # what SGLang's scheduler does when it fails
        finally:
            signal.signal(signal.SIGQUIT, previous)
        assert engine_child.wait(timeout=10) == -signal.SIGKILL
        assert earlier.poll() is None
    finally:
        earlier.kill()
        earlier.wait()
