"""Session fixtures of the megatron tier: HF references (in this process) and one launch per world size.

Launches (each runs many checks, to pay megatron-core's import once per rank; a check is a function of a test
file decorated with ``mcore_check(<launch>)``, see ``workers/mcore_worker.py``):
  single: 1 process          -> CPU compat, TP = 1 checks, NaN guard, resume, refusals
  pair:   torchrun, 2 ranks  -> TP = 2, PP = 2, DP = 2 checks, NaN guard at PP = 2, DistributedOptimizer,
                                bf16 export at PP = 2, sequence parallel at TP = 2, a one-row batch at DP = 2,
                                the learner's sleep and wake at TP = 2, PP = 2 and DP = 2 (bf16 DistributedOptimizer)
  grid:   torchrun, 4 ranks  -> TP = 2 x PP = 2 checks, TP1 checkpoint -> TP2 x PP2 -> TP1, DistributedOptimizer,
                                a one-row batch at TP = 2 x DP = 2
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "workers"))

from mcore_harness import LaunchResult, launch, run_cli  # noqa: E402


@pytest.fixture(scope="session")
def mcore_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mcore")


@pytest.fixture(scope="session")
def mcore_refs(mcore_root) -> Path:
    """``ref.pt`` with the HF references; the HF checkpoints live next to it."""
    from mcore_reference import build_references

    return build_references(mcore_root / "hf")


@pytest.fixture(scope="session")
def tp1_checkpoint(mcore_refs, mcore_root) -> Path:
    """``sparse-rl convert hf-to-megatron`` of the tied Qwen2 model (a TP = PP = 1 torch_dist checkpoint)."""
    out = mcore_root / "tp1_ckpt"
    proc = run_cli("convert", "hf-to-megatron", "--input", str(mcore_refs.parent / "qwen2_tied"), "--output", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def single_launch(mcore_refs, mcore_root) -> LaunchResult:
    work = mcore_root / "single_work"
    work.mkdir()
    return launch("w_single.py", 1, [str(mcore_refs), str(work)], mcore_root / "single_results")


@pytest.fixture(scope="session")
def pair_launch(mcore_refs, mcore_root) -> LaunchResult:
    work = mcore_root / "pair_work"
    work.mkdir()
    return launch("w_layouts.py", 2, ["pair", str(mcore_refs), str(work)],
                  mcore_root / "pair_results")


@pytest.fixture(scope="session")
def grid_launch(mcore_refs, mcore_root, tp1_checkpoint) -> LaunchResult:
    work = mcore_root / "grid_work"
    work.mkdir()
    return launch("w_layouts.py", 4, ["grid", str(mcore_refs), str(work), str(tp1_checkpoint)],
                  mcore_root / "grid_results", timeout=600)


# Mixtures of experts (test_moe_parity.py): two launches of their own, one per world size.
#   moe_pair: torchrun, 2 ranks -> EP = 1 and EP = 2 (DP = 2) checks of both MoE models, the load-balancing step,
#             uneven micro-batch counts, W11-W13
#   moe_grid: torchrun, 4 ranks -> TP = 2 x EP = 2 (expert TP 2), PP = 2 x EP = 2, TP1 checkpoint -> PP2 x EP2 -> EP4
@pytest.fixture(scope="session")
def moe_refs(mcore_root) -> Path:
    """``moe_ref.pt`` with the HF references of the MoE models; their HF checkpoints live next to it."""
    from moe_reference import build_moe_references

    return build_moe_references(mcore_root / "moe_hf")


@pytest.fixture(scope="session")
def moe_tp1_checkpoint(moe_refs, mcore_root) -> Path:
    """``sparse-rl convert hf-to-megatron`` of the Qwen3-MoE model (a TP = PP = EP = 1 torch_dist checkpoint)."""
    out = mcore_root / "moe_tp1_ckpt"
    proc = run_cli("convert", "hf-to-megatron", "--input", str(moe_refs.parent / "qwen3_moe"), "--output", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def moe_pair_launch(moe_refs, mcore_root) -> LaunchResult:
    work = mcore_root / "moe_pair_work"
    work.mkdir()
    return launch("w_moe.py", 2, ["moe_pair", str(moe_refs), str(work)],
                  mcore_root / "moe_pair_results")


@pytest.fixture(scope="session")
def moe_grid_launch(moe_refs, mcore_root, moe_tp1_checkpoint) -> LaunchResult:
    work = mcore_root / "moe_grid_work"
    work.mkdir()
    return launch("w_moe.py", 4, ["moe_grid", str(moe_refs), str(work), str(moe_tp1_checkpoint)],
                  mcore_root / "moe_grid_results", timeout=600)
