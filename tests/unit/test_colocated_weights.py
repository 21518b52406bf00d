"""Weights for a colocated engine that spans two ranks (``trainer/engine_pool/colocated_weights.py``), on two gloo
processes:
each rank serializes its own copy of every bucket with ForkingPickler (what SGLang's serializer runs: shared
memory here, CUDA-IPC handles on GPU), the engine's first rank receives both payloads in TP-rank order and opens
the other rank's tensors (as the engine's TP rank 1 would), and that rank keeps them alive until the barrier after
the push. (SGLang's own serializer, ``sglang_weights.serialize_bucket``, runs in the SGLang training test.)"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

ROOT = Path(__file__).resolve().parents[2]
BUCKETS = 3


def _bucket(k: int, rank: int) -> list:
    # the learner's export gives every rank the same bucket; a rank marker shows whose copy was opened
    return [(f"w{k}", torch.full((4, 3), float(10 * k + rank))), (f"b{k}", torch.arange(5.0) + rank)]


def _serialize(bucket) -> bytes:
    return bytes(ForkingPickler.dumps([(n, t.detach()) for n, t in bucket]))


def _worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from sparse_rl_megatron.rollout.layout import RolloutLayout
    from sparse_rl_megatron.trainer.engine_pool.colocated_weights import ColocatedPayloads

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    layout = RolloutLayout.build(engine="sglang", world=2, ranks_per_node=2, gpus_per_engine=2, groups=1)
    payloads = ColocatedPayloads(layout, rank, timeout_s=120, serialize=_serialize)
    seen = []
    for k in range(BUCKETS):
        bucket = _bucket(k, rank)
        gathered = payloads.gather(bucket)
        if rank == 0:  # the driver: payload r is TP rank r's, from learner rank r
            assert len(gathered) == 2
            for tp_rank, payload in enumerate(gathered):
                tensors = dict(ForkingPickler.loads(payload))
                seen.append((k, tp_rank, float(tensors[f"w{k}"][0, 0]), tensors[f"b{k}"].tolist()))
        else:
            assert gathered is None
        payloads.release()
    if rank == 0:
        torch.save(seen, out)
    dist.destroy_process_group()


def test_each_tp_rank_gets_the_bucket_of_the_learner_rank_on_its_gpu(tmp_path):
    init = f"file://{tmp_path / 'store'}"
    out = tmp_path / "seen.pt"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(init, str(out)), nprocs=2, join=True, start_method="spawn")
    seen = torch.load(out)
    assert seen == [(k, r, float(10 * k + r), [float(i + r) for i in range(5)]) for k in range(BUCKETS) for r in (0, 1)]
