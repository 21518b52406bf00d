"""A run directory is held by one live process; a dead holder's lock is taken over; archives never collide."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sparse_rl_megatron.utils.errors import UserError
from sparse_rl_megatron.trainer.runtime.run_dir import LOCK_FILE, RunDirBusy, RunDirLock, archive_previous_outputs

HOLD = textwrap.dedent("""
    import sys, time
    from sparse_rl_megatron.trainer.runtime.run_dir import RunDirLock
    lock = RunDirLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(60)
""")


def _holder(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_is_refused_with_the_holders_pid(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=rf"in use by pid {proc.pid} on ") as err:
            RunDirLock(tmp_path).acquire()
        assert isinstance(err.value, UserError)
    finally:
        proc.kill()
        proc.wait()


def test_lock_of_a_killed_run_is_taken_over_and_said(tmp_path):
    proc = _holder(tmp_path)
    proc.kill()  # SIGKILL: no clean-up ran, the record is still in the file
    proc.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == proc.pid
    with RunDirLock(tmp_path) as lock:
        assert lock.taken_over["pid"] == proc.pid
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    # a clean release leaves nothing to take over
    with RunDirLock(tmp_path) as lock:
        assert lock.taken_over is None


def test_archive_moves_only_named_outputs_and_never_overwrites(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("1\n")
    (tmp_path / "keep.txt").write_text("x")
    first = archive_previous_outputs(tmp_path, ["metrics.jsonl", "checkpoint"])
    assert (first / "metrics.jsonl").read_text() == "1\n" and (tmp_path / "keep.txt").exists()
    assert archive_previous_outputs(tmp_path, ["metrics.jsonl"]) is None
    (tmp_path / "metrics.jsonl").write_text("2\n")
    second = archive_previous_outputs(tmp_path, ["metrics.jsonl"])
    assert second != first and (second / "metrics.jsonl").read_text() == "2\n"
    assert (first / "metrics.jsonl").read_text() == "1\n"
