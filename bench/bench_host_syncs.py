"""Host syncs per decode step in the sparse_kv plugin's hooks: this checkout, and the plugin of another git revision
(``--rev``, e.g. the one before issue 17), side by side.

The plugin is driven in-process over SGLang's real pools (``tests/sglang/plugin_rig.py``: 4 requests, 2 layers,
4 query / 2 KV heads, R-KV B = 6, W = 2, alpha = 2); ``sglang_ext.host_syncs.HostSyncCounter`` counts what would
make the host wait for a GPU (device-to-host reads, blocking host-to-device copies, data-dependent shapes) inside
the plugin's forward hooks (``init_forward_metadata``, the layers' ``forward_*``, ``after_forward``) and its
release of a compressed row; the inner backend's own calls are not counted. A revision's ``sglang_ext`` is
extracted with ``git archive`` and its hooks are wrapped the same way. Decode batches carry no host rows, as in
SGLang before the plugin's ``ForwardBatch.init_new`` hook (this checkout's numbers get them from the hook).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_host_syncs.py --rev 1489dd4

Not a test (``tests/sglang/test_host_syncs.py`` asserts this checkout's numbers).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path

from plugin_revisions import THIS_CHECKOUT, run_per_revision  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _counter_module():
    spec = importlib.util.spec_from_file_location("current_host_syncs", ROOT / "sglang_ext" / "host_syncs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(steps: int, digest: bool, old: bool) -> dict:
    """Per decode step (syncs, rows that compressed), and the syncs of releasing the 4 requests."""
    import contextlib
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "tests" / "sglang"))
    from sglang_ext import cpu_compat

    cpu_compat.apply()
    import plugin_rig
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention

    from sglang_ext import accounting, backend
    from sglang_ext.config import SparseKVConfig
    from sparse_rl_megatron.compression import CompressionConfig

    hs = _counter_module()
    counter = hs.HostSyncCounter()

    def switched(fn, on: bool):
        @functools.wraps(fn)
        def run(*a, **k):
            if on:
                with counter:
                    return fn(*a, **k)
            counter.enabled = False
            try:
                return fn(*a, **k)
            finally:
                counter.enabled = True
        return run

    if old:   # the old plugin has no counted hooks: count around them
        for name in ("init_forward_metadata", "forward_decode", "forward_extend", "after_forward"):
            setattr(backend.SparseKVBackend, name, switched(getattr(backend.SparseKVBackend, name), True))
        accounting.release_row = switched(accounting.release_row, True)
        counting = contextlib.nullcontext
    else:     # this checkout counts inside its own hooks
        from sglang_ext import host_syncs

        counter = host_syncs.HostSyncCounter()
        counting = functools.partial(host_syncs.install, counter)
    config = SparseKVConfig(compression=CompressionConfig(method="rkv", budget=6, window=2, buffer=2),
                            kept_digest=digest)
    rig = plugin_rig.PluginRig.__new__(plugin_rig.PluginRig)
    rig.runner = plugin_rig.RunnerAttributes(rows=4, context=64, pool_tokens=512)
    with plugin_rig.published_parallel():
        rig.backend = backend.SparseKVBackend(rig.runner, config)
    if old:   # and not inside its inner backend
        for name in ("init_forward_metadata", "forward_decode", "forward_extend"):
            setattr(rig.backend.inner, name, switched(getattr(rig.backend.inner, name), False))
    rig.layers = [RadixAttention(plugin_rig.Q_HEADS, plugin_rig.HEAD_DIM, plugin_rig.HEAD_DIM ** -0.5,
                                 plugin_rig.KV_HEADS, layer_id=i) for i in range(plugin_rig.LAYERS)]
    rig.seq, rig.gen = {}, torch.Generator().manual_seed(0)
    ids = rig.admit(4)
    rig.forward(ids, [5, 11, 3, 7], decode=False)
    per_step = []
    for _ in range(steps):
        before, start = rig.backend.state.events[ids].copy(), counter.total
        with counting():
            rig.forward(ids, 1, decode=True, host_rows=not old)
        per_step.append((counter.total - start, int((rig.backend.state.events[ids] > before).sum())))
    start = counter.total
    with counting():
        for row in ids:
            kv = SimpleNamespace(req_pool_idx=row, cache_protected_len=0, kv_allocated_len=rig.seq[row])
            accounting.release_row(rig.backend, kv, [(0, rig.seq[row])], rig.runner.token_to_kv_pool_allocator)
    backend._ACTIVE = None   # the next measurement builds its own backend in this process
    quiet = [s for s, c in per_step if c == 0]
    busy = [s for s, c in per_step if c > 0]
    return {"digest": digest, "quiet": [min(quiet), max(quiet)], "compressing": [min(busy), max(busy)],
            "release_4": counter.total - start}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rev", default="", help="also measure the sglang_ext of this git revision")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:   # one measurement in this process (the package on sys.path decides which plugin)
        old = args.child == "old"
        print(json.dumps([measure(args.steps, d, old) for d in (False, True)]))
        return
    runs = run_per_revision(__file__, args.rev, lambda label: [
        "--steps", str(args.steps), "--child", "new" if label == THIS_CHECKOUT else "old"])
    print("| plugin | kept digests | decode step, no compression | decode step that compresses | release 4 requests |")
    print("|---|---|---|---|---|")
    for label, results in runs.items():
        for r in results:
            span = lambda x: f"{x[0]}" if x[0] == x[1] else f"{x[0]}-{x[1]}"  # noqa: E731
            print(f"| {label} | {'on' if r['digest'] else 'off'} | {span(r['quiet'])} | {span(r['compressing'])} | "
                  f"{r['release_4']} |")


if __name__ == "__main__":
    main()
