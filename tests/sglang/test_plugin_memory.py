"""The plugin's memory: what it allocates is the formula (``sglang_ext.memory``), the formula is taken out of
SGLang's KV budget before the pool is sized, and a compression's transients are bounded by chunks of rows and KV
heads without changing what is kept."""
from __future__ import annotations

import json

import pytest
import torch
from plugin_rig import HEAD_DIM, KV_HEADS, LAYERS, Q_HEADS, PluginRig

from sglang_ext import score_chunks as chunking
from sglang_ext.config import SparseKVConfig
from sglang_ext.memory import plugin_memory
from sparse_rl_megatron.compression import CompressionConfig


def chunk_peak_bytes(rows: int, heads: int, *, pair_bytes: int, row_bytes: int,
                     budget: int = chunking.SCORE_CHUNK_BYTES) -> int:
    """The largest transient of ``score_chunks``' chunks (what a compressing step adds at its peak)."""
    rs, hs = chunking.score_chunks(rows, heads, pair_bytes=pair_bytes, row_bytes=row_bytes, budget=budget)[0]
    return (rs.stop - rs.start) * (row_bytes + (hs[0].stop - hs[0].start) * pair_bytes)

RKV = CompressionConfig(method="rkv", budget=6, window=2, buffer=2)


TRI = CompressionConfig(method="triattention", budget=6, window=2, buffer=2)


@pytest.mark.parametrize("config", [SparseKVConfig(compression=RKV, kept_digest=True),
                                    SparseKVConfig(compression=RKV), SparseKVConfig(),
                                    SparseKVConfig(compression=TRI, kept_digest=True)],
                         ids=["rkv-digest", "rkv", "dense", "triattention-digest"])
def test_allocation_is_the_formula(config):
    rig = PluginRig(config, rows=6, context=48)
    try:
        rows, width = rig.runner.req_to_token_pool.req_to_token.shape
        c = config.compression
        want = plugin_memory(rows=rows, width=width, layers=LAYERS, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                             head_dim=HEAD_DIM, window=c.window, max_candidates=c.max_candidates, ring_itemsize=4,
                             keep_queries=not c.is_dense, keep_positions=config.kept_digest and not c.is_dense,
                             keep_centers=c.method == "triattention")
        assert rig.backend.state.nbytes == want.total == rig.backend.memory.total
        # by hand: int32 table, float32 rings [L, rows, Hq, alpha, D], int32 positions [L, rows, Hkv, B + W]
        hand = rows * width * 4
        if not c.is_dense:
            hand += LAYERS * rows * Q_HEADS * c.window * HEAD_DIM * 4
            hand += LAYERS * rows * KV_HEADS * c.max_candidates * 4 if config.kept_digest else 0
            # float32 query-center sums [L, rows, Hq, D] and [L, rows, Hq, D / 2] (triattention)
            hand += LAYERS * rows * Q_HEADS * (HEAD_DIM + HEAD_DIM // 2) * 4 if c.method == "triattention" else 0
        assert want.total == hand
        assert f"for {rows} rows" in want.describe()
    finally:
        rig.close()


def test_reserved_out_of_the_kv_budget_before_the_pool(tiny_model_dir, monkeypatch):
    """The hook on KVCacheConfigurator._profile_available_bytes returns SGLang's budget less the formula for the
    most rows the pool may get (max_running_requests + the padding row), in a scheduler's published context."""
    from types import SimpleNamespace

    from sglang_helpers import resolved_server_args

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
    from sglang.srt.runtime_context import create_context, use_context
    from sglang_ext import memory
    from sglang_ext.config import CONFIG_ENV

    config = SparseKVConfig(compression=RKV, kept_digest=True)
    args = resolved_server_args(tiny_model_dir, json.loads(config.to_json()), max_running_requests=7, dtype="float32")
    with use_context(create_context(args, role="scheduler")):
        mc = ModelConfig.from_server_args(args)
        configurator = SimpleNamespace(is_draft_worker=False, model_config=mc, model_dtype=torch.float32)
        budget = 10 << 30
        monkeypatch.setenv(CONFIG_ENV, config.to_json())
        left = memory.reserve_before_kv_pool(lambda *_: budget, configurator)
        extra = get_req_to_token_extra_context_len()
    want = plugin_memory(rows=8, width=mc.context_len + extra, layers=LAYERS, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, window=RKV.window, max_candidates=RKV.max_candidates, ring_itemsize=4,
                         keep_queries=True, keep_positions=True)
    assert left == budget - want.total and memory.reserved() == want


def test_chunks_cover_the_grid_within_the_bound():
    for rows, heads, pair, row in [(37, 8, 1000, 300), (5, 4, 10 ** 9, 10), (1, 1, 10, 10), (64, 2, 7, 3)]:
        budget = 4000
        chunks = chunking.score_chunks(rows, heads, pair_bytes=pair, row_bytes=row, budget=budget)
        cells = [(r, h) for rs, hss in chunks for r in range(rs.start, rs.stop) for hs in hss
                 for h in range(hs.start, hs.stop)]
        assert sorted(cells) == [(r, h) for r in range(rows) for h in range(heads)]
        peak = chunk_peak_bytes(rows, heads, pair_bytes=pair, row_bytes=row, budget=budget)
        assert peak <= max(budget, row + pair)              # one (row, head) pair is the least there is
    # the peak does not grow with how many rows compress at once
    assert chunk_peak_bytes(4, 4, pair_bytes=500, row_bytes=100, budget=4000) == \
        chunk_peak_bytes(4000, 4, pair_bytes=500, row_bytes=100, budget=4000)


def _run(config, chunk_bytes, monkeypatch):
    monkeypatch.setattr(chunking, "SCORE_CHUNK_BYTES", chunk_bytes)
    rig = PluginRig(config, rows=4, context=64, pool_tokens=512, seed=5)
    try:
        ids = rig.admit(4)
        rig.forward(ids, [5, 11, 3, 7], decode=False)
        for _ in range(9):
            rig.forward(ids, 1, decode=True)
        state = rig.backend.state
        return ([state.info[r].meta["kept_digest"] for r in ids], [t.tolist() for t in rig.physical_rows(ids)],
                state.events[ids].tolist())
    finally:
        rig.close()


@pytest.mark.parametrize("method", ["rkv", "snapkv", "triattention"])
def test_chunked_compression_keeps_the_same_tokens(method, monkeypatch):
    config = SparseKVConfig(compression=CompressionConfig(method=method, budget=6, window=2, buffer=2),
                            kept_digest=True)
    whole = _run(config, 1 << 30, monkeypatch)
    pairs = _run(config, 1, monkeypatch)            # one (row, KV head) at a time
    assert min(whole[2]) >= 2 and whole == pairs
