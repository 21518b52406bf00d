"""Host syncs in the plugin's hooks, counted (``sglang_ext.host_syncs``): what would make the host wait for a GPU
(device-to-host reads, blocking host-to-device copies, data-dependent shapes) per decode step, in-process over
SGLang's real pools (``plugin_rig``). Targets (issue 17): none per row or per layer; at most 1 on a step with
no compression, a few on a compressing one. The inner backend's own metadata is not the plugin's and not counted.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from plugin_rig import PluginRig

from sglang_ext import host_syncs
from sglang_ext.config import SparseKVConfig
from sparse_rl_megatron.compression import CompressionConfig

PROMPTS = [5, 11, 3, 7]


def _steps(config: SparseKVConfig, steps: int = 12, rows: int = 4):
    """Prefill ``rows`` requests, then decode ``steps`` times; per decode step (syncs, staged copies, rows that
    compressed), then the syncs of releasing every request."""
    rig = PluginRig(config, rows=rows, context=64, pool_tokens=512)
    try:
        ids = rig.admit(rows)
        rig.forward(ids, PROMPTS[:rows], decode=False)
        out = []
        for _ in range(steps):
            before = rig.backend.state.events[ids].copy()
            with host_syncs.install() as counter:
                rig.forward(ids, 1, decode=True)
            out.append((counter.total, counter.staged, int((rig.backend.state.events[ids] > before).sum())))
        with host_syncs.install() as counter:
            for row in ids:
                rig.release(row)
        alloc = rig.runner.token_to_kv_pool_allocator
        assert alloc.available_size() == alloc.size   # every slot back, none twice
        return out, counter.total
    finally:
        rig.close()


@pytest.mark.parametrize("digest", [False, True])
def test_decode_steps_sync_a_constant_not_per_row_or_layer(digest):
    config = SparseKVConfig(compression=CompressionConfig(method="rkv", budget=6, window=2, buffer=2),
                            kept_digest=digest)
    steps, release = _steps(config)
    quiet = [s for s, _, c in steps if c == 0]
    compressing = [(s, c) for s, _, c in steps if c > 0]
    assert quiet and compressing and max(c for _, c in compressing) >= 2     # several rows compress together
    assert max(quiet) == 0                                                   # target: <= 1
    assert max(s for s, _ in compressing) == (1 if digest else 0)            # the kept digests: one copy per step
    assert all(staged <= 3 for _, staged, _ in steps)                        # asynchronous copies, a few per step
    assert release == 0


def test_dense_and_streaming_steps_too():
    for method in ("none", "streamingllm", "snapkv", "triattention"):
        config = SparseKVConfig(compression=CompressionConfig(method=method, budget=6, window=2, buffer=2))
        steps, release = _steps(config, steps=8)
        assert max(s for s, _, _ in steps) == 0 and release == 0, method


def test_the_counter_sees_what_would_sync():
    """The oracle itself: each kind of sync is counted, device-only work is not."""
    t = torch.arange(8)
    with host_syncs.install() as counter:
        @host_syncs.counted
        def hook():
            t.sum().item()                          # device -> host
            t[t > 3]                                # boolean mask: data-dependent shape
            torch.as_tensor([1, 2])                 # blocking host -> device
            t[np.array([1, 2])]                     # numpy index: host -> device
            torch.nonzero(t)                        # data-dependent shape
            t[2:5] * 2 + t.flip(0)[:3]              # device only
            host_syncs.to_device(np.arange(3), "cpu")   # staged (asynchronous on a GPU)
            with host_syncs.not_counted():
                t.tolist()                          # the inner backend's, not the plugin's
        hook()
    assert counter.total == 5 and counter.staged == 1, counter.counts


def test_rows_read_from_the_device_cost_one_sync():
    """Without the rows recorded at batch build (the ForwardBatch.init_new hook), the plan reads them: 1 sync."""
    rig = PluginRig(SparseKVConfig(compression=CompressionConfig(method="rkv", budget=6, window=2, buffer=2)))
    try:
        ids = rig.admit(2)
        rig.forward(ids, [3, 4], decode=False)
        with host_syncs.install() as counter:
            rig.forward(ids, 1, decode=True, host_rows=False)
        assert counter.total == 1
    finally:
        rig.close()
