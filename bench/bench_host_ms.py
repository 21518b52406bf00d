"""Host milliseconds per decode step of the sparse_kv plugin's own work, at 64, 256, 1024 and 4096 rows: this
checkout and the plugin of another git revision (``--rev``) side by side, with their ratio.

The plugin is driven in-process over SGLang's real pools (``tests/sglang/plugin_rig.py``'s runner: 2 layers, 4
query / 2 KV heads, head dim 16, R-KV B = 12, W = 4, alpha = 3, scope all, 8-11 prompt tokens). What is timed is the plugin's host work of one
decode step: ``init_forward_metadata`` without the inner backend's own metadata, the per-layer query-ring writes
(``forward_decode`` without the inner kernel) and ``after_forward``. Two kinds of steps:

- ``plain``: rows at the same phase compress together every W steps; the median is a step where none does;
- ``mixed``: rows at staggered phases, so 1/W of them compress in each step (what a running batch does).

Both after every row's first compression (a warm-up of B + 2W steps).

Each row's request is bound as the scheduler binds it (``RowInfo`` with a compression config); decode batches carry
host rows (the plugin's ``ForwardBatch.init_new`` hook). Median over ``--steps`` steps after a warm-up, in CPU time of the process (one thread; a shared machine's
other load does not count).

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python bench/bench_host_ms.py --rev main

Not a test (timings on a shared machine are not asserted anywhere).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from plugin_revisions import THIS_CHECKOUT, run_per_revision  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROWS = (64, 256, 1024, 4096)
PROMPT = 8


def measure(rows: int, steps: int, mixed: bool) -> float:
    """Median host ms of the plugin's work per decode step (see the module docstring)."""
    sys.path.insert(0, str(ROOT / "tests" / "sglang"))
    from sglang_ext import cpu_compat

    cpu_compat.apply()
    import plugin_rig
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from sglang_ext import backend as backend_mod
    from sglang_ext.config import SparseKVConfig
    from sparse_rl_megatron.compression import CompressionConfig

    compression = CompressionConfig(method="rkv", budget=12, window=3, buffer=4, scope="all")
    width = PROMPT + 2 * compression.max_candidates + steps + 8
    runner = plugin_rig.RunnerAttributes(rows=rows, context=width, pool_tokens=rows * width + 16)
    with plugin_rig.published_parallel():
        be = backend_mod.SparseKVBackend(runner, SparseKVConfig(compression=compression))
    be.inner.init_forward_metadata = lambda fb: None   # the inner backend's own work is not the plugin's
    layers = [RadixAttention(plugin_rig.Q_HEADS, plugin_rig.HEAD_DIM, plugin_rig.HEAD_DIM ** -0.5,
                             plugin_rig.KV_HEADS, layer_id=i) for i in range(plugin_rig.LAYERS)]
    ids = list(runner.req_to_token_pool.alloc_rows(rows))
    rtt, alloc = runner.req_to_token_pool.req_to_token, runner.token_to_kv_pool_allocator
    # staggered (mixed) or aligned (plain) lengths: a row compresses when its candidates reach B + W
    prefill = [PROMPT + (i % compression.buffer if mixed else 0) for i in range(rows)]
    seq = {}
    gen = torch.Generator().manual_seed(0)

    def step(new: list[int], decode: bool) -> float:
        out = alloc.alloc(sum(new))
        start = 0
        for row, e in zip(ids, new):
            rtt[row, seq.get(row, 0):seq.get(row, 0) + e] = out[start:start + e].to(rtt.dtype)
            seq[row] = seq.get(row, 0) + e
            start += e
        s = torch.tensor([seq[r] for r in ids], dtype=torch.int64)
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        fb = ForwardBatch(forward_mode=mode, batch_size=rows, input_ids=torch.zeros(sum(new), dtype=torch.int64),
                          req_pool_indices=torch.tensor(ids, dtype=torch.int64), seq_lens=s.clone(),
                          out_cache_loc=out, seq_lens_sum=int(s.sum()), seq_lens_cpu=s.clone())
        if not decode:
            ext = torch.tensor(new, dtype=torch.int64)
            fb.extend_seq_lens, fb.extend_prefix_lens = ext, s - ext
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(new), (s - ext).tolist()
            fb.extend_num_tokens = sum(new)
        fb.req_pool_indices_cpu = torch.tensor(ids, dtype=torch.int64)
        runner.kv_index_translator.own_plan(fb).bind(fb, runner.kv_index_translator)
        q = torch.randn(sum(new), plugin_rig.Q_HEADS * plugin_rig.HEAD_DIM, generator=gen)
        kv = torch.randn(sum(new), plugin_rig.KV_HEADS, plugin_rig.HEAD_DIM, generator=gen)
        for layer in layers:   # the new tokens' K/V in the pool (what the inner backend's forward stores)
            runner.token_to_kv_pool.set_kv_buffer(layer, out, kv, kv)
        t0 = time.process_time()
        be.init_forward_metadata(fb)
        for layer in layers:
            be.scaling.setdefault(layer.layer_id, float(layer.scaling))
            be._record_queries(q, layer)
        be.after_forward()
        return 1e3 * (time.process_time() - t0)

    step(prefill, decode=False)
    for _ in range(compression.max_candidates + compression.buffer):   # past every row's first compression
        step([1] * rows, decode=True)
    times = [step([1] * rows, decode=True) for _ in range(steps)]
    backend_mod._ACTIVE = None
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rev", default="", help="also measure the sglang_ext of this git revision")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:   # one checkout's numbers in this process (the package on sys.path decides which plugin)
        print(json.dumps({kind: [measure(r, args.steps, kind == "mixed") for r in rows]
                          for kind in ("plain", "mixed")}))
        return
    results = run_per_revision(__file__, args.rev,
                               lambda label: ["--steps", str(args.steps), "--rows", args.rows, "--child", "1"])
    head = "| step | rows | this checkout (ms) |" + (f" {args.rev} (ms) | {args.rev} / this |" if args.rev else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for kind in ("plain", "mixed"):
        for i, r in enumerate(rows):
            new = results[THIS_CHECKOUT][kind][i]
            line = f"| {kind} | {r} | {new:.2f} |"
            if args.rev:
                old = results[args.rev][kind][i]
                line += f" {old:.2f} | {old / new:.2f}x |"
            print(line)


if __name__ == "__main__":
    main()
