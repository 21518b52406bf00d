"""Megatron learner speed at TP1 / TP2 / PP2, and peak memory of chunked vs unchunked log-probs.

1. Throughput: a small random Qwen2 (HF checkpoint written to a temp dir) loaded by the ``Learner`` at
   TP=1 (1 process), TP=2 and PP=2 (torchrun, 2 processes, gloo on CPU); forward-only dense log-probs and
   one corrected-GRPO train step per iteration, tokens/s (tokens fed to the model) with ratios vs TP=1.
2. Memory: one row of ``--mem-tokens`` response tokens with a ``--mem-vocab`` vocabulary, log-probs (and a
   train step) with the LM head chunked (``--chunk`` tokens) vs unchunked; each cell runs in a fresh process
   and reports its peak RSS increase over the RSS just before the call (VmHWM, reset before the call). On CUDA the peak
   is ``torch.cuda.max_memory_allocated`` and throughput also reports MFU (not run on CPU): model FLOPs as
   computed (``learner/flops.py``: causal attention included, the LM head on response tokens only).

On a GPU machine each rank takes one GPU; layouts needing more GPUs than are visible are skipped (and said so).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_learner.py               # both parts
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_learner.py --skip-memory # throughput only

Not a test: timings on a shared 2-core machine are noisy (the fastest of ``--iters`` iterations is kept).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from math import prod
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kit.part_learner import random_batch, train_batch  # noqa: E402  (the GPU kit's batches)

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# bf16 dense peak of one H200 (the device kind this project may be lent), for MFU on CUDA.
PEAK_FLOPS = {"cuda": 989e12}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP layouts (TP1, TP2, PP2)")
    p.add_argument("--rows", type=int, default=16, help="sequences per batch")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=192)
    p.add_argument("--max-tokens", type=int, default=1024, help="micro-batch token budget per device")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per cell (the fastest is kept)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--mem-tokens", type=int, default=4096, help="response tokens of the memory row")
    p.add_argument("--mem-vocab", type=int, default=151936, help="vocabulary of the memory model (Qwen2.5)")
    p.add_argument("--chunk", type=int, default=512, help="LM-head chunk of the chunked cells")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--worker", choices=["throughput", "memory"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="1x1", help=argparse.SUPPRESS)
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------- helpers
def write_model(out: Path, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> Path:
    from sparse_rl_megatron.models.tiny import build_tiny_model

    model = build_tiny_model("qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                             num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, tie_word_embeddings=True,
                             init_std=0.02)
    model.save_pretrained(out)
    return out


def learner_for(args, model_dir: str, tp: int, pp: int, chunk: int):
    from sparse_rl_megatron.learner import Learner, LearnerConfig

    return Learner(LearnerConfig(model_path=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 params_dtype="auto", layer_spec="auto", max_tokens_per_device=args.max_tokens,
                                 logprob_chunk_tokens=chunk))


# ----------------------------------------------------------------------------------------------- workers
def worker_throughput(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    tp, pp = (int(x) for x in args.layout.split("x"))
    learner = learner_for(args, args.model_dir, tp, pp, args.chunk)
    seqs = random_batch(args.rows, args.prompt_len, args.response_len, learner.arch.vocab_size)
    tokens = sum(seqs.lengths)
    batch = train_batch(learner, seqs)  # also the warm-up of the forward path
    learner.train_step(batch)  # warm-up of the backward path
    fwd, step = [], []
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        learner.logprobs(seqs)
        fwd.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        learner.train_step(batch)
        step.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        out = dict(layout=args.layout, tokens=tokens, fwd_s=min(fwd), step_s=min(step),
                   fwd_tps=tokens / min(fwd), step_tps=tokens / min(step), world=dist.get_world_size())
        if torch.cuda.is_available():
            from sparse_rl_megatron.learner.flops import forward_flops, train_step_flops

            scored = int(seqs.response_mask().sum())
            peak = PEAK_FLOPS["cuda"] * dist.get_world_size()
            out.update(fwd_mfu=forward_flops(learner.arch, seqs.lengths, scored) / min(fwd) / peak,
                       step_mfu=train_step_flops(learner.arch, seqs.lengths, scored) / min(step) / peak)
        print("RESULT " + json.dumps(out), flush=True)


def worker_memory(args) -> None:
    torch.set_num_threads(1)
    learner = learner_for(args, args.model_dir, 1, 1, args.chunk)
    small = random_batch(1, 16, 16, learner.arch.vocab_size)
    seqs = random_batch(1, 16, args.mem_tokens, learner.arch.vocab_size)
    learner.logprobs(small)  # warm-up: lazy allocations (and Adam's moments) outside the measured call
    if args.train:
        from sparse_rl_megatron.learner import TrainBatch

        learner.train_step(TrainBatch(small, _prepared_like(small)))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        base = _rss_bytes()
    t0 = time.perf_counter()
    if args.train:
        learner.train_step(TrainBatch(seqs, _prepared_like(seqs)))
    else:
        learner.logprobs(seqs)
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else _max_rss_bytes()) - base
    print("RESULT " + json.dumps(dict(chunk=args.chunk, train=args.train, peak_bytes=peak, seconds=seconds,
                                      tokens=args.mem_tokens, vocab=learner.arch.vocab_size)), flush=True)


def _prepared_like(seqs):
    from sparse_rl_megatron.algo import prepare_correction

    mask = seqs.response_mask()
    old = torch.full(mask.shape, -5.0) * mask
    return prepare_correction(old, old.clone(), mask, torch.ones(len(seqs)), torch.zeros(len(seqs), dtype=torch.long))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _max_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------------------------- driver
def _run(cmd: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"benchmark worker failed ({' '.join(cmd[-6:])}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _common(args) -> list[str]:
    return ["--max-tokens", str(args.max_tokens), "--rows", str(args.rows), "--prompt-len", str(args.prompt_len),
            "--response-len", str(args.response_len), "--iters", str(args.iters), "--chunk", str(args.chunk),
            "--mem-tokens", str(args.mem_tokens)]


def runnable_layouts(layouts: list[str], gpus: int | None) -> tuple[list[str], list[str]]:
    """``(layouts to run, why each other one is skipped)``: one process per GPU, so a TP x PP layout needs
    TP x PP visible GPUs (``gpus``; None on CPU, where every layout runs as CPU processes)."""
    run, skipped = [], []
    for layout in layouts:
        world = prod(int(x) for x in layout.split("x"))
        if gpus is not None and world > gpus:
            skipped.append(f"{layout} (needs {world} GPUs, {gpus} visible)")
        else:
            run.append(layout)
    return run, skipped


def throughput(args, tmp: Path) -> list[dict]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    layouts, skipped = runnable_layouts(args.layouts, gpus)
    for why in skipped:
        print(f"  skipped {why}", flush=True)
    if not layouts:
        return []
    model = write_model(tmp / "small", args.vocab, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads)
    results = []
    for layout in layouts:
        tp, pp = (int(x) for x in layout.split("x"))
        world = tp * pp
        script = [str(Path(__file__).resolve()), "--worker", "throughput", "--model-dir", str(model),
                  "--layout", layout, *_common(args)]
        if world == 1:
            cmd = [PYTHON, *script]
        else:
            from sparse_rl_megatron.learner.parallel import free_port

            cmd = [PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
                   f"--master_port={free_port()}", *script]
        results.append(_run(cmd))
        print(f"  {layout}: {results[-1]}", flush=True)
    return results


def print_throughput(res: list[dict]) -> None:
    """The throughput table, ratios against the first layout that ran (MFU columns when measured on CUDA)."""
    if not res:
        print("no layout fits the visible GPUs", flush=True)
        return
    base, mfu = res[0], "fwd_mfu" in res[0]
    base_name = _layout_name(base["layout"])
    print(f"\n| layout | procs | log-probs tok/s | x {base_name} | train step tok/s | x {base_name} |"
          + (" log-probs MFU | train MFU |" if mfu else ""))
    print("| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if mfu else ""))
    for r in res:
        print(f"| {_layout_name(r['layout'])} | {r['world']} | {r['fwd_tps']:.0f} | "
              f"{r['fwd_tps'] / base['fwd_tps']:.2f} | {r['step_tps']:.0f} | {r['step_tps'] / base['step_tps']:.2f} |"
              + (f" {r['fwd_mfu']:.1%} | {r['step_mfu']:.1%} |" if mfu else ""))


def _layout_name(layout: str) -> str:
    return {"1x1": "TP1", "2x1": "TP2", "1x2": "PP2"}.get(layout, layout)


def memory(args, tmp: Path) -> list[dict]:
    # one layer, 2 query heads: the local attention still builds [heads, s, s] scores (~0.27 GB at 4096
    # tokens), so keep it small next to the [s, vocab] logits this measures.
    model = write_model(tmp / "wide_vocab", args.mem_vocab, 64, 128, 1, 2, 1)
    results = []
    for train in (False, True):
        for chunk in (args.chunk, 0):
            cmd = [PYTHON, str(Path(__file__).resolve()), "--worker", "memory", "--model-dir", str(model),
                   *_common(args), "--chunk", str(chunk), "--max-tokens", str(args.mem_tokens + 64)]
            results.append(_run(cmd + (["--train"] if train else [])))
            print(f"  train={train} chunk={chunk}: {results[-1]}", flush=True)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "throughput":
        worker_throughput(args)
        return 0
    if args.worker == "memory":
        worker_memory(args)
        return 0
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"cuda={torch.cuda.is_available()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as tmp:
        if not args.skip_throughput:
            print(f"throughput: qwen2 L={args.layers} H={args.hidden} heads={args.heads}/{args.kv_heads} "
                  f"vocab={args.vocab}; {args.rows} rows x ({args.prompt_len}+{args.response_len}) tokens, "
                  f"budget {args.max_tokens} tokens/micro-batch", flush=True)
            res = throughput(args, Path(tmp))
            print_throughput(res)
        if not args.skip_memory:
            print(f"\nmemory: 1 row x {args.mem_tokens} response tokens, vocab {args.mem_vocab}", flush=True)
            res = memory(args, Path(tmp))
            print("\n| call | LM head | peak extra memory | time |")
            print("| --- | --- | --- | --- |")
            for r in res:
                head = f"chunked ({r['chunk']} tok)" if r["chunk"] else "unchunked"
                call = "train step" if r["train"] else "log-probs"
                print(f"| {call} | {head} | {r['peak_bytes'] / 2**30:.2f} GiB | {r['seconds']:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
