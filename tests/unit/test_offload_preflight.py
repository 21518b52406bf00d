"""``learner.offload`` that a node's host memory cannot hold is refused before any model loads, in one line naming
what each mode needs (``trainer/run_plan.check_offload_host_memory``)."""
from pathlib import Path

import pytest

from sparse_rl_megatron.models.catalog import hf_config
from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.trainer.run_plan import check_offload_host_memory, offload_host_bytes
from sparse_rl_megatron.utils.config_io import load_config
from sparse_rl_megatron.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
GIB = 2 ** 30
N_TP2 = 3_807_808_256  # Qwen2.5-7B's parameters on one GPU at TP 2 (its 7,615,616,512 / 2; the embedding padded evenly)


def _recipe(**overrides) -> TrainConfig:
    cfg = load_config(TrainConfig, ROOT / "configs" / "recipes" / "qwen2.5-7b" / "rkv.yaml")
    for key, value in overrides.items():
        setattr(cfg.learner, key, value)
    return cfg


def test_host_bytes_per_rank_are_the_sleeping_weights_and_optimizer_state():
    """7B at TP 2 x DP 4, bf16, distributed optimizer, a KL reference: ``all`` keeps 2 N of weights, 12 N / 4 of
    optimizer shards and the reference's 2 N on the host (gradients are dropped, not copied); ``optimizer`` the
    shards only."""
    cfg, hf = _recipe(), hf_config("qwen2.5-7b")
    n = offload_host_bytes(cfg, hf, 8, "optimizer", on_gpu=True) / 3  # 12 N / 4
    assert abs(n - N_TP2) / N_TP2 < 1e-3
    assert offload_host_bytes(cfg, hf, 8, "all", on_gpu=True) == pytest.approx((2 + 3 + 2) * n, rel=1e-9)
    assert offload_host_bytes(cfg, hf, 8, "none", on_gpu=True) == 0


def test_a_node_without_the_host_memory_is_refused_naming_what_fits():
    cfg, hf = _recipe(), hf_config("qwen2.5-7b")
    with pytest.raises(UserError) as err:
        check_offload_host_memory(cfg, hf, 8, 8, on_gpu=True, available=100 * GIB)
    text = str(err.value)
    assert "\n" not in text and text.startswith("learner.offload=all keeps 24.8 GiB per rank in host memory")
    assert "198.6 GiB for the 8 ranks of this node, but the node has 100.0 GiB available; valid here: none (0.0 GiB), " \
           "optimizer (85.1 GiB) (or more GPUs)" in text
    check_offload_host_memory(cfg, hf, 8, 8, on_gpu=True, available=200 * GIB)  # enough: no error
    check_offload_host_memory(_recipe(offload="none"), hf, 8, 8, on_gpu=True, available=0)  # nothing sleeps
    check_offload_host_memory(cfg, None, 8, 8, on_gpu=True, available=0)  # a model the run builds: tiny
