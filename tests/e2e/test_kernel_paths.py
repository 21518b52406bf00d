"""The numerics-sensitive tests pass on a second kernel path of this CPU, so a tolerance tuned to one path (or one
CPU) is caught in CI: PyTorch's ``ATEN_CPU_CAPABILITY`` and MKL's ``MKL_ENABLE_INSTRUCTIONS`` switch their kernels
(AVX-512 / AVX2 / SSE), which sum in other orders. A representative subset re-runs in a subprocess on the
next path down from the one this machine uses: the megatron learner vs HF (logits, log-probs, chunked head,
export, one training step; TP 1; the mixtures of experts at EP 1, whose two-rank launch runs its EP 2 checks too),
HF engine shards vs the whole batch, the HF engine vs full-forward oracles (dense and MoE), the tolerances' seeded
defects, and the warm-start check in a fast form (a tiny task's real supervised stage, its check, the retry on a
miss: the embedded default's warm start landed differently on another CPU, issue 38)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ["tests/megatron/test_parity_and_logprobs.py", "tests/megatron/test_train_step.py",
          "tests/megatron/test_tolerances.py", "tests/megatron/test_moe_parity.py",
          "tests/unit/test_rollout_engine_shards.py", "tests/unit/test_rollout_hf_engine.py",
          "tests/unit/test_rollout_moe.py", "tests/unit/test_task_warm_check.py"]
# the megatron files: the single-process launch only ("TP1" alone also matched the two-rank launch's "tp1pp2" and
# "tp1pp1" items, which started a torchrun pair for them)
# the MoE files: their two-rank launch only (its EP 1 and EP 2 items), not the four-rank one (moe_grid, reshard)
SELECT = ("(TP1 or shards or hf_engine or tolerances or rollout_moe or warm_check) and not pair_launch and not moe_grid "
          "and not reshard")
# the path below each one: (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, what torch then reports)
NEXT_PATH = {"AVX512": ("avx2", "AVX2", "AVX2"), "AVX2": ("default", "SSE4_2", "DEFAULT"),
             "DEFAULT": ("avx2", "AVX2", "AVX2")}


def test_the_numerics_subset_passes_on_a_second_kernel_path(tmp_path):
    here = torch.backends.cpu.get_cpu_capability()
    if here not in NEXT_PATH:
        pytest.skip(f"no second kernel path known below {here}")
    aten, mkl, want = NEXT_PATH[here]
    env = dict(os.environ, ATEN_CPU_CAPABILITY=aten, MKL_ENABLE_INSTRUCTIONS=mkl, OMP_NUM_THREADS="1")
    got = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    if got != want:  # e.g. an AVX2-only machine asked for AVX2 from DEFAULT: nothing else to try
        pytest.skip(f"ATEN_CPU_CAPABILITY={aten} gives {got} on this CPU ({here} by default)")
    # one process (-n 0): this test's worker already shares the machine with the suite's other worker
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-k", SELECT,
                           f"--basetemp={tmp_path / 'run'}", *SUBSET], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"on kernel path {got} (default {here}):\n{tail}"
    assert " passed" in tail and "failed" not in tail, tail
