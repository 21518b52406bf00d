"""TP above the KV head count (``sglang_ext.tp_heads``): every replica of a KV head keeps the tokens the unsharded
selection keeps, because it scores with the head's whole query group gathered from its sibling replicas.

Heads are sharded the way SGLang's ``QKVParallelLinear`` shards them: rank r holds query heads
``[r * Hq / tp, (r + 1) * Hq / tp)`` and KV head ``r // (tp / Hkv)``. Checked with the gather simulated (every
rank's shard stacked in rank order, what an all-gather returns) and with a real gloo all-gather over 4 processes.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from sglang_ext.tp_heads import QueryGroups
from sparse_rl_megatron.compression import CompressionConfig, ScoreInputs, choose_kept

HQ, HKV, TP, ROWS, N, D = 8, 2, 4, 3, 20, 16
CONFIGS = [CompressionConfig(method=m, budget=8, window=3, buffer=4) for m in ("rkv", "snapkv")]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(ROWS, HKV, N, D, generator=g)
    values = torch.randn(ROWS, HKV, N, D, generator=g)
    queries = torch.randn(ROWS, HQ, 3, D, generator=g) * 2.0
    return keys, values, queries


def _shard(keys, values, queries, rank: int):
    """What rank ``rank`` of TP holds: one KV head (replicated) and Hq / TP query heads."""
    kv, q = rank // (TP // HKV), HQ // TP
    return keys[:, kv:kv + 1], values[:, kv:kv + 1], queries[:, rank * q:(rank + 1) * q]


def _selections(config, keys, values, queries, rank: int, all_gather):
    k, v, q = _shard(keys, values, queries, rank)
    groups = QueryGroups(tp_rank=rank, tp_size=TP, total_kv_heads=HKV, all_gather=all_gather)
    whole = choose_kept(config, ScoreInputs(keys=k, values=v, queries=groups.whole_group(q)))
    local = choose_kept(config, ScoreInputs(keys=k, values=v, queries=q))
    return whole, local


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.method)
def test_every_replica_keeps_the_unsharded_selection(config):
    keys, values, queries = _inputs()
    unsharded = choose_kept(config, ScoreInputs(keys=keys, values=values, queries=queries))   # [rows, Hkv, B]

    def all_gather(x):   # every rank's query shard, rank order
        return torch.stack([_shard(keys, values, queries, r)[2] for r in range(TP)])

    differs = 0
    for rank in range(TP):
        whole, local = _selections(config, keys, values, queries, rank, all_gather)
        kv = rank // (TP // HKV)
        assert torch.equal(whole, unsharded[:, kv:kv + 1]), rank
        differs += int(not torch.equal(local, unsharded[:, kv:kv + 1]))
    assert differs > 0   # scoring with the local query heads only keeps other tokens (the bug this fixes)


def test_no_gather_when_every_rank_has_whole_kv_heads():
    groups = QueryGroups(tp_rank=1, tp_size=2, total_kv_heads=2, all_gather=lambda x: pytest.fail("gathered"))
    q = torch.randn(2, 4, 3, D)
    assert not groups.needed and groups.whole_group(q) is q
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        QueryGroups(tp_rank=0, tp_size=3, total_kv_heads=2)


def _gloo_rank(rank: int, store_path: str, out_dir: str):
    """One of 2 TP ranks sharing the single KV head of a 4-query-head model (R = 2), with gloo."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        def all_gather(x):
            parts = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(parts, x)
            return torch.stack(parts)

        keys, values, queries = _inputs()
        k, v, q = keys[:, :1], values[:, :1], queries[:, rank * 2:(rank + 1) * 2]
        groups = QueryGroups(tp_rank=rank, tp_size=2, total_kv_heads=1, all_gather=all_gather)
        torch.save(choose_kept(CONFIGS[0], ScoreInputs(keys=k, values=v, queries=groups.whole_group(q))),
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_with_a_real_all_gather_over_gloo(tmp_path):
    mp.spawn(_gloo_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    keys, values, queries = _inputs()
    unsharded = choose_kept(CONFIGS[0], ScoreInputs(keys=keys[:, :1], values=values[:, :1], queries=queries[:, :4]))
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), unsharded), rank


def test_triattention_replicas_score_with_the_whole_groups_centers():
    """The plugin's query-center sums are sharded like the queries: a compression gathers the KV head's whole group
    of centers (``compaction._centers``) and every replica keeps the unsharded TriAttention selection."""
    from types import SimpleNamespace

    from sglang_ext.compaction import _centers

    config = CompressionConfig(method="triattention", budget=8, window=3, buffer=4)
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(ROWS, HKV, N, D, generator=g), torch.randn(ROWS, HKV, N, D, generator=g)
    qsum, qabs = torch.randn(ROWS, HQ, D, generator=g) * 5, torch.rand(ROWS, HQ, D // 2, generator=g) * 9
    count, position, inv_freq = torch.tensor([3, 5, 7]), torch.tensor([30, 31, 40]), torch.rand(D // 2, generator=g)
    unsharded = choose_kept(config, ScoreInputs(keys=keys, values=values, query_center=qsum / count[:, None, None],
                                                query_abs_center=qabs / count[:, None, None],
                                                query_position=position, rope_inv_freq=inv_freq))
    q = HQ // TP

    def all_gather(x):   # every rank's mean of the same sums, rank order
        full = (qsum if x.shape[-1] == D else qabs) / count[:, None, None]
        return torch.stack([full[:, r * q:(r + 1) * q].unsqueeze(-2) for r in range(TP)])

    for rank in range(TP):
        kv = rank // (TP // HKV)
        shard = SimpleNamespace(qsum=[qsum[:, rank * q:(rank + 1) * q]], qabs=[qabs[:, rank * q:(rank + 1) * q]])
        backend = SimpleNamespace(state=shard, inv_freq=inv_freq, query_groups=QueryGroups(
            tp_rank=rank, tp_size=TP, total_kv_heads=HKV, all_gather=all_gather))
        centers = _centers(backend, 0, torch.arange(ROWS), count, position)
        assert centers["query_center"].shape == (ROWS, HQ // HKV, D)
        kept = choose_kept(config, ScoreInputs(keys=keys[:, kv:kv + 1], values=values[:, kv:kv + 1], **centers))
        assert torch.equal(kept, unsharded[:, kv:kv + 1]), rank
