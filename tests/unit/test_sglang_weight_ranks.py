"""``distributed`` weight sync: every server's ranks come from its own reported widths (SGLang puts a server's
TP rank r at ``rank_offset + r``), a server SGLang cannot sync this way (DP replicas, PP) is refused naming the
alternative, and so is NCCL to an in-process engine on this process's GPU (NCCL refuses two ranks on one GPU).
The gloo path runs for real in tests/sglang/test_sglang_engine.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparse_rl_megatron.rollout import sglang_weights as sw


def test_rank_offsets_follow_each_servers_tp():
    assert sw.rank_layout([(1, 1, 1)]) == ([1], 2)
    assert sw.rank_layout([(2, 1, 1), (4, 1, 1), (1, 1, 1)]) == ([1, 3, 7], 8)   # not 1 + i * tp_size
    with pytest.raises(ValueError, match="server 1 runs dp_size=2, pp_size=1: .*one server per replica"):
        sw.rank_layout([(2, 1, 1), (2, 2, 1)])
    with pytest.raises(ValueError, match="pp_size=2"):
        sw.rank_layout([(1, 1, 2)])


def test_widths_from_server_info():
    assert sw.widths({"tp_size": 4, "dp_size": 1, "pp_size": None}) == (4, 1, 1)


def test_gpus_of_an_in_process_engine():
    info = {"tp_size": 2, "dp_size": 1, "base_gpu_id": 2, "gpu_id_step": 1}
    assert [sw.shares_gpu(info, d) for d in range(5)] == [False, False, True, True, False]
    assert sw.shares_gpu({"tp_size": 2, "base_gpu_id": 0, "gpu_id_step": 2}, 2)
    assert not sw.shares_gpu({"tp_size": 2, "base_gpu_id": 0, "gpu_id_step": 2}, 1)


def test_nccl_to_a_colocated_in_process_engine_is_refused(monkeypatch):
    engine = SimpleNamespace(config=SimpleNamespace(distributed_backend="nccl"), client=SimpleNamespace(in_process=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(RuntimeError, match="runs on this process's GPU 0; NCCL refuses two ranks .* 'tensor'"):
        sw._check_distributed(engine, [{"tp_size": 1, "base_gpu_id": 0}])
    sw._check_distributed(engine, [{"tp_size": 1, "base_gpu_id": 1}])          # another GPU: fine
    engine.config.distributed_backend = "gloo"
    sw._check_distributed(engine, [{"tp_size": 1, "base_gpu_id": 0}])          # gloo goes through the host
