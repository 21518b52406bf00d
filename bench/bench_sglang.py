"""Concurrency and decode speed of SGLang at a fixed KV pool: the sparse_kv plugin vs dense vs "read a subset,
free nothing" (the published Sparse-RL fork's behaviour), side by side.

Each mode starts SGLang's CPU engine with the same model, the same fixed pool (``--pool`` tokens) and the
same requests (``--requests`` distinct prompts, EOS ignored, so every response is ``--response`` tokens),
all submitted at once. Modes (all through the sparse_kv backend, so every forward logs the pool):

- ``dense``: compression method none (SGLang's own admission and memory; the plugin only mirrors tables);
- ``plugin``: R-KV at budget B / buffer W, evicted slots freed, admission sized by B + W;
- ``fork``: R-KV selection with the same B / W, but nothing is freed and admission stays dense.

Reported per mode: the most requests decoding at once (max batch of a decode forward, from the plugin's
pool log, sampled every ``--stats-every`` forwards), their mean, peak slots in use, decode tokens per second of wall time and per second
of the scheduler's CPU time, and the share of the scheduler's CPU time spent compressing. Ratios are
against ``dense`` of the same run. Defaults keep the paper's proportions scaled down for a CPU
(response 4096 : B 512 : W 128 -> 512 : 64 : 16).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sglang.py                 # ~25 min on 2 busy cores
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sglang.py --requests 16 --response 128 --budget 16 --buffer 4

``--inner-backend triton`` runs the same modes over SGLang's triton attention backend (the GPU default) in
Triton's interpreter: the concurrency, slot and retained-token columns are the GPU path's; its speed columns are
the interpreter's, not a speed figure.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sglang.py --inner-backend triton --requests 16 --response 64 \
        --budget 16 --buffer 4 --window 4 --pool 512 --triton-kv-splits 2

Not a test. The scheduler runs in its own process; CPU times are that process's (``time.process_time``
logged by the plugin), wall times include the noise of a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench_rollout import add_model_args, model_kwargs

MODES = ("dense", "plugin", "fork")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--pool", type=int, default=4096, help="KV pool size in tokens (the same for every mode)")
    p.add_argument("--requests", type=int, default=40, help="requests submitted at once")
    p.add_argument("--response", type=int, default=512, help="response tokens per request (EOS ignored)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--budget", type=int, default=64, help="B")
    p.add_argument("--buffer", type=int, default=16, help="W")
    p.add_argument("--window", type=int, default=8, help="alpha")
    p.add_argument("--method", default="rkv")
    p.add_argument("--max-running", type=int, default=128, help="SGLang's max_running_requests (not the limit)")
    p.add_argument("--stats-every", type=int, default=8, help="the plugin logs the pool every k-th forward")
    p.add_argument("--inner-backend", default="torch_native", choices=("torch_native", "triton"),
                   help="attention kernels under the plugin (triton: in Triton's interpreter on CPU)")
    p.add_argument("--triton-kv-splits", type=int, default=8, help="triton decode KV splits (SGLang's default 8)")
    add_model_args(p)
    return p.parse_args(argv)


def plugin_config(args, mode: str, stats: Path) -> dict:
    compression = {"method": "none"} if mode == "dense" else {
        "method": args.method, "budget": args.budget, "buffer": args.buffer, "window": args.window}
    return {"compression": compression, "free_evicted": mode != "fork", "stats_path": str(stats),
            "stats_every": args.stats_every, "inner_backend": args.inner_backend}


def run_mode(args, mode: str, model_dir: Path, prompts: list[list[int]], workdir: Path) -> dict:
    import sglang

    from sglang_ext import cpu_compat
    from sglang_ext.config import BACKEND_NAME, CONFIG_ENV

    stats = workdir / f"{mode}.jsonl"
    os.environ[CONFIG_ENV] = json.dumps(plugin_config(args, mode, stats))
    kwargs = {**cpu_compat.cpu_engine_kwargs(), "attention_backend": BACKEND_NAME}
    if args.inner_backend == "triton":
        kwargs["triton_attention_num_kv_splits"] = args.triton_kv_splits
    # distinct prompts: the radix cache would share nothing (and a fork-mode copy of a shared prompt would
    # need slots that mode never frees)
    engine = sglang.Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=args.pool,
                           max_running_requests=args.max_running, disable_radix_cache=True, random_seed=0,
                           log_level="error", **kwargs)
    try:
        sampling = {"temperature": 1.0, "max_new_tokens": args.response, "ignore_eos": True}
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sampling)
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    tokens = sum(len(o["output_ids"]) for o in outs)
    lines = [json.loads(x) for x in stats.read_text().splitlines()]
    decode = [x for x in lines if x.get("decode")]
    forwards = [x for x in lines if "cpu" in x]
    cpu = forwards[-1]["cpu"] - forwards[0]["cpu"]
    return {"mode": mode, "tokens": tokens, "max_running": max(x["running"] for x in decode),
            "mean_running": sum(x["running"] for x in decode) / len(decode),
            "peak_used": max(x["used"] for x in lines if "used" in x), "wall_s": wall, "sched_cpu_s": cpu,
            "tok_s_wall": tokens / wall, "tok_s_cpu": tokens / cpu,
            "compress_share": (forwards[-1]["compact_cpu"] - forwards[0]["compact_cpu"]) / cpu,
            "retained_max": max(max(x["phys"]) for x in decode)}


def main(argv=None) -> None:
    args = parse_args(argv)
    import platform

    import torch

    from sglang_ext import cpu_compat
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

    cpu_compat.apply()
    workdir = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    model_dir = save_tiny_hf_checkpoint(workdir / "model", "qwen2", seed=0, **model_kwargs(args))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, args.vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.requests)]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, pool {args.pool} tokens, "
          f"{args.requests} requests x {args.response} tokens (prompt {args.prompt_len}), {args.method} "
          f"B={args.budget} W={args.buffer} alpha={args.window}, inner backend {args.inner_backend}")
    results = [run_mode(args, mode, model_dir, prompts, workdir) for mode in args.modes]
    base = next((r for r in results if r["mode"] == "dense"), results[0])
    header = ("mode", "max running", "x dense", "mean running", "peak slots", "max retained", "tok/s wall",
              "x dense", "tok/s sched-CPU", "x dense", "compress share")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in results:
        print(f"| {r['mode']} | {r['max_running']} | {r['max_running'] / base['max_running']:.2f} | "
              f"{r['mean_running']:.1f} | {r['peak_used']} | {r['retained_max']} | {r['tok_s_wall']:.0f} | "
              f"{r['tok_s_wall'] / base['tok_s_wall']:.2f} | {r['tok_s_cpu']:.0f} | "
              f"{r['tok_s_cpu'] / base['tok_s_cpu']:.2f} | {100 * r['compress_share']:.1f}% |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
