"""Decode speed and retained KV of the HF reference rollout engine: dense vs compressed, side by side.

For each response length, generates the same batch (one prompt x ``--batch`` samples, EOS ignored, so
every sequence is exactly that long) with each method, and prints decode tokens/s and the peak KV tokens
retained per sequence (per layer and KV head), with ratios against dense measured in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rollout.py                     # B=128, W=32, 256/1024/4096
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rollout.py --lengths 64 256    # quick look

Not a test. Speed is measured in CPU time of this process (``time.process_time``, one torch thread), so
other jobs on a shared machine slow it less than wall time would; wall-clock tok/s is printed too. Methods
are interleaved and the fastest of ``--repeats`` runs is kept.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.rollout.kv_cache import CompressedKVCache

_COMPRESS_SECONDS = [0.0]
_original_compress = CompressedKVCache.compress


def _timed_compress(self, rows):
    """Wraps the cache's compression to report its share of the generate time (bench only)."""
    start = time.process_time()
    _original_compress(self, rows)
    _COMPRESS_SECONDS[0] += time.process_time() - start


CompressedKVCache.compress = _timed_compress
from sparse_rl_megatron.models.tiny import build_tiny_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096], help="response lengths")
    p.add_argument("--methods", nargs="+", default=["none", "rkv", "snapkv"], help="'none' = dense (the baseline)")
    p.add_argument("--budget", type=int, default=128, help="B")
    p.add_argument("--buffer", type=int, default=32, help="W")
    p.add_argument("--window", type=int, default=8, help="alpha")
    p.add_argument("--batch", type=int, default=4, help="sequences decoded together (one prompt x batch samples)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="runs per cell (methods interleaved); the fastest is kept")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_model_args(p)
    return p.parse_args(argv)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """A small random Qwen2 (4.9M parameters: vocabulary 2048, hidden 256, 6 layers, 4 heads over 2 KV heads), its
    shape flags."""
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)


def model_kwargs(args) -> dict:
    """``build_tiny_model`` / ``save_tiny_hf_checkpoint`` keyword arguments from :func:`add_model_args`' flags."""
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads)


def make_engine(model, method: str, args) -> HFRolloutEngine:
    compression = None if method == "none" else CompressionConfig(
        method=method, budget=args.budget, window=args.window, buffer=args.buffer)
    return HFRolloutEngine(model, compression=compression, max_batch_size=args.batch, show_progress=False)


def run_once(engine: HFRolloutEngine, length: int, args) -> tuple[float, float, int, int, float]:
    """(CPU seconds, wall seconds, peak retained KV tokens per sequence, compression events per sequence,
    CPU seconds compressing) of one generate call."""
    prompt = torch.randint(3, args.vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=length, ignore_eos=True, seed=0)
    _COMPRESS_SECONDS[0] = 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    samples = engine.generate([prompt], args.batch, sampling)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert all(len(s.response_ids) == length for s in samples)
    peak = max(s.compression.peak_kv_tokens for s in samples)
    return cpu, wall, peak, max(s.compression.events for s in samples), _COMPRESS_SECONDS[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_tiny_model("qwen2", seed=0, **model_kwargs(args),
                             max_position_embeddings=max(args.lengths) + args.prompt_len + 8)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"# machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); model: random Qwen2 {params:.2f}M params, {args.layers} layers, "
          f"{args.heads} q / {args.kv_heads} kv heads, hidden {args.hidden}")
    print(f"# batch {args.batch} sequences, prompt {args.prompt_len} tokens, B={args.budget} W={args.buffer} "
          f"alpha={args.window}, fp32, best of {args.repeats}")
    engines = {m: make_engine(model, m, args) for m in args.methods}
    for engine in engines.values():  # warm-up: first calls pay for allocator growth and lazy initialisation
        run_once(engine, 2 * (args.budget + args.buffer), args)
    print("| response | method | decode tok/CPU-s | x dense | wall tok/s | peak KV / seq | x dense | events / seq "
          "| CPU in compression |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in args.lengths:
        best: dict[str, tuple[float, float, int, int, float]] = {}
        for _ in range(args.repeats):  # methods interleaved, so a load change on the machine hits all of them
            for method, engine in engines.items():
                run = run_once(engine, length, args)
                if method not in best or run[0] < best[method][0]:
                    best[method] = run
        base_speed, base_peak = None, None
        for method, (cpu, wall, peak, events, compressing) in best.items():
            speed = args.batch * length / cpu
            if base_speed is None:
                base_speed, base_peak = speed, peak
            print(f"| {length} | {'dense' if method == 'none' else method} | {speed:.1f} | {speed / base_speed:.2f} "
                  f"| {args.batch * length / wall:.1f} | {peak} | {peak / base_peak:.3f} | {events} "
                  f"| {100 * compressing / cpu:.1f}% |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
