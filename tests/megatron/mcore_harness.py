"""Run megatron worker scripts (plain python or torchrun + gloo) and report their checks to pytest.

A worker (``workers/mcore_worker.run_launch``) runs the checks of its launch (functions of the test files,
decorated with ``mcore_check``) in order on every rank and records each outcome in ``rank<r>.json``. Here each
check becomes its own test result, reported by the test that passes the check function: pass, fail with the
failing rank's traceback (which points into the test file), or "did not run" with the launch's output tail (a
check after the first failure).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mcore_worker import check_key, mcore_check

ROOT = Path(__file__).resolve().parents[2]
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable


# ---------------------------------------------------------------------------------------------- pytest side
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchResult:
    """Outcome of one launch: per-check, per-rank records and the output tail."""

    nproc: int
    returncode: int
    output: str
    records: dict[str, dict[int, dict]] = field(default_factory=dict)
    seconds: float = 0.0

    def check(self, fn: Callable, **params) -> None:
        """Fail the calling test unless the check ``fn`` (a function decorated with ``mcore_check``) passed with
        ``params`` on every rank."""
        import pytest

        name = check_key(fn, params)
        per_rank = self.records.get(name, {})
        failed = {r: rec for r, rec in per_rank.items() if rec["status"] == "fail"}
        if failed:
            r, rec = sorted(failed.items())[0]
            pytest.fail(f"check '{name}' failed on rank {r} (of ranks {sorted(failed)}):\n{rec['traceback']}",
                        pytrace=False)
        if len(per_rank) < self.nproc:
            pytest.fail(
                f"check '{name}' did not run on all {self.nproc} ranks (ran on {sorted(per_rank)}); launch exit "
                f"code {self.returncode}. Output tail:\n{self.output[-6000:]}", pytrace=False)


def launch(worker: str, nproc: int, args: list[str], result_dir: Path, timeout: float = 420) -> LaunchResult:
    """Run ``tests/megatron/workers/<worker>`` on ``nproc`` ranks (gloo, a free port per launch)."""
    script = str(ROOT / "tests" / "megatron" / "workers" / worker)
    result_dir.mkdir(parents=True, exist_ok=True)
    if nproc == 1:
        cmd = [PYTHON, script, str(result_dir), *args]
    else:
        cmd = [PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", script, str(result_dir), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT), TORCH_CPP_LOG_LEVEL="ERROR",
               CUDA_VISIBLE_DEVICES="")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session: torchrun and its workers
        output, _ = proc.communicate()
        code, output = -9, f"TIMEOUT after {timeout}s\n{output}"
    result = LaunchResult(nproc=nproc, returncode=code, output=output, seconds=time.perf_counter() - t0)
    for r in range(nproc):
        path = result_dir / f"rank{r}.json"
        if path.is_file():
            for rec in json.loads(path.read_text()):
                result.records.setdefault(rec["check"], {})[r] = rec
    return result


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m sparse_rl_megatron.cli ARGS`` in a fresh process (megatron patches stay out of pytest)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([PYTHON, "-m", "sparse_rl_megatron.cli", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


MODELS = ("qwen2_tied", "qwen2_untied", "llama", "qwen3")
# (launch fixture, layout tag: the checks' ``layout`` parameter) of every layout the issue asks for
LAYOUTS = {
    "TP1": ("single_launch", "tp1"),
    "TP2": ("pair_launch", "tp2pp1"),
    "PP2": ("pair_launch", "tp1pp2"),
    "DP2": ("pair_launch", "tp1pp1"),
    "TP2xPP2": ("grid_launch", "tp2pp2"),
}


def tp_pp(tag: str) -> tuple[int, int]:
    """The TP and PP sizes of a layout tag (``tp2pp1``; ``tp1``: TP = PP = 1)."""
    m = re.fullmatch(r"tp(\d+)(?:pp(\d+))?", tag)
    return int(m[1]), int(m[2] or 1)


def at_every_layout(fn: Callable) -> Callable:
    """Register the check ``fn(ctx, layout, model)`` for every model at every layout of ``LAYOUTS``, each in the
    launch that has the layout (``single``, ``pair``, ``grid``)."""
    for launch_name in ("single", "pair", "grid"):
        fn = mcore_check(launch_name, params=[{"layout": tag, "model": m} for fixture, tag in LAYOUTS.values()
                                              if fixture == f"{launch_name}_launch" for m in MODELS])(fn)
    return fn
