"""How much of a synchronous GRPO step's decode waits for its last responses (issue 54, "measure the tail first"), on
SGLang's CPU engine with the sparse_kv plugin at a fixed KV pool, dense and compressed, side by side.

One step = all of its requests (``--groups`` prompts x ``--n`` samples) submitted at once; the step's rows are those
request slots. A row is idle from its request's finish until the step's last request finishes. Reported per workload
and mode:

- p50 / p90 / max response length (tokens);
- idle row-steps (lockstep): ``sum_i (max_len - len_i) / (rows * max_len)``, exact from the response lengths for a
  batch that decodes all rows in lockstep from the first step (:func:`idle_row_step_share`);
- idle row-time (engine): ``1 - sum_i t_i / (rows * t_max)``, with ``t_i`` the request's finish time as SGLang
  reports it (``meta_info['e2e_latency']``: from the request's creation in the tokenizer manager to its finish, so
  it includes queueing and prefill); the same quantity measured in wall time;
- p50 / p90 finish (s) against the makespan (wall seconds of the step: what a synchronous training step waits for),
  and decode tokens per second of makespan; the most requests decoding at once (the plugin's pool log).

Both modes run on one engine per workload with the same pool (``--pool`` tokens); the engine's compression is
R-KV (``--budget`` / ``--buffer`` / ``--window``), the dense mode's requests carry ``method: none`` as their own
compression (what ``CompressionView`` does for a dense evaluation of a sparse-rollout server).

Workloads:
  geometric: a tiny random Qwen2 (vocabulary 512, near-uniform logits: ``init_std`` 0.002) whose last
      ``--eos-tokens`` token ids stop a response, so lengths are geometric (mean ~ 512 / eos tokens) cut at
      ``--tiny-max-new``: a few responses run many times the median;
  smollm2: SmolLM2-135M-Instruct (an HF directory converted by ``sparse-rl convert gguf-to-hf``; the real-model
      tier caches one under ``.pytest_cache/d/realmodel/``) on GSM8K test prompts from ``../shared/data`` with its
      chat template, EOS as the model's, cut at ``--max-new``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_tail.py                        # both workloads, ~5 min
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_tail.py --workloads geometric --groups 2 --n 4

Not a test: wall times are a shared machine's; compare within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_CACHE = ROOT / ".pytest_cache" / "d" / "realmodel" / "smollm2-135m-instruct"
WORKLOADS = ("geometric", "smollm2")
TINY_VOCAB = 512


def idle_row_step_share(lengths) -> float:
    """Share of a lockstep batch's row-steps spent idle: every row starts at step 0 and the batch decodes until its
    longest response ends, so row ``i`` idles for ``max - len_i`` of the ``max`` steps."""
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 0:
        raise ValueError(f"idle_row_step_share: lengths must be a non-empty list of counts >= 0; got {lengths}")
    longest = max(lengths)
    if longest == 0:
        return 0.0
    return sum(longest - x for x in lengths) / (len(lengths) * longest)


def idle_row_time_share(finish_s) -> float:
    """The same share in wall time: rows start together, row ``i`` is busy until ``finish_s[i]``, the step ends at
    the last finish."""
    finish_s = [float(x) for x in finish_s]
    last = max(finish_s)
    return 0.0 if last <= 0 else 1.0 - sum(finish_s) / (len(finish_s) * last)


def quantile(values, q: float) -> float:
    """The ``q`` quantile (linear interpolation between order statistics)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--model", default=str(SMOLLM2_CACHE), help="smollm2: the converted HF directory")
    p.add_argument("--groups", type=int, default=3, help="GRPO groups (prompts) per step")
    p.add_argument("--n", type=int, default=4, help="samples per group")
    p.add_argument("--max-new", type=int, default=256, help="smollm2: max_new_tokens")
    p.add_argument("--tiny-max-new", type=int, default=512, help="geometric: max_new_tokens")
    p.add_argument("--tiny-groups", type=int, default=16, help="geometric: groups per step")
    p.add_argument("--eos-tokens", type=int, default=4, help="geometric: how many token ids stop a response")
    p.add_argument("--pool", type=int, default=32768, help="KV pool in tokens (the same for both modes)")
    p.add_argument("--budget", type=int, default=64, help="compressed: R-KV budget B")
    p.add_argument("--buffer", type=int, default=16, help="compressed: buffer W")
    p.add_argument("--window", type=int, default=8, help="compressed: observation window alpha")
    p.add_argument("--max-running", type=int, default=128, help="SGLang's max_running_requests")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _prompts(args, workload: str, model_dir: Path) -> tuple[list[list[int]], dict]:
    """Each group's prompt token ids and the workload's stop condition (sampling parameters)."""
    if workload == "geometric":
        import torch

        gen = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(10, TINY_VOCAB - args.eos_tokens, (16,), generator=gen).tolist()
                   for _ in range(args.tiny_groups)]
        return prompts, {"stop_token_ids": list(range(TINY_VOCAB - args.eos_tokens, TINY_VOCAB)),
                         "max_new_tokens": args.tiny_max_new}
    from transformers import AutoTokenizer

    from sparse_rl_megatron.data.sets import load_dataset

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    records = list(load_dataset("gsm8k"))[: args.groups]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r.prompt}], tokenize=True,
                                       add_generation_prompt=True) for r in records]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    return prompts, {"max_new_tokens": args.max_new}


def _model_dir(args, workload: str, workdir: Path) -> Path:
    if workload == "smollm2":
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise SystemExit(f"{model}: no HF model directory; convert one with `sparse-rl convert gguf-to-hf` "
                             "or run the real-model tier once (tests/realmodel) to cache it")
        return model
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

    return save_tiny_hf_checkpoint(workdir / "tiny", "qwen2", seed=args.seed, init_std=0.002, vocab_size=TINY_VOCAB,
                                   max_position_embeddings=args.tiny_max_new + 64)


def _mode_row(outs: list[dict], wall: float, stats_lines: list[dict]) -> dict:
    lengths = [len(o["output_ids"]) for o in outs]
    finish = [o["meta_info"]["e2e_latency"] for o in outs]
    decode = [x for x in stats_lines if x.get("decode")]
    return {"responses": len(outs), "p50_len": quantile(lengths, 0.5), "p90_len": quantile(lengths, 0.9),
            "max_len": max(lengths), "idle_lockstep": idle_row_step_share(lengths),
            "idle_time": idle_row_time_share(finish), "p50_finish_s": quantile(finish, 0.5),
            "p90_finish_s": quantile(finish, 0.9), "last_finish_s": max(finish), "makespan_s": wall,
            "tok_s": sum(lengths) / wall, "max_running": max((x["running"] for x in decode), default=0),
            "lengths": lengths}


def run_workload(args, workload: str, workdir: Path) -> list[dict]:
    import sglang

    from sglang_ext import cpu_compat
    from sglang_ext.config import BACKEND_NAME, CONFIG_ENV, request_params
    from sparse_rl_megatron.compression import CompressionConfig

    model_dir = _model_dir(args, workload, workdir)
    prompts, stop = _prompts(args, workload, model_dir)
    stats = workdir / f"{workload}.jsonl"
    compressed = CompressionConfig(method="rkv", budget=args.budget, buffer=args.buffer, window=args.window)
    os.environ[CONFIG_ENV] = json.dumps({
        "compression": {"method": "rkv", "budget": args.budget, "buffer": args.buffer, "window": args.window},
        "free_evicted": True, "stats_path": str(stats), "stats_every": 4, "inner_backend": "torch_native"})
    kwargs = {**cpu_compat.cpu_engine_kwargs(), "attention_backend": BACKEND_NAME}
    engine = sglang.Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=args.pool,
                           max_running_requests=args.max_running, disable_radix_cache=True, random_seed=args.seed,
                           log_level="error", **kwargs)
    n = args.n
    ids = [p for p in prompts for _ in range(n)]
    rows = []
    try:
        for mode, compression in (("dense", CompressionConfig()), ("compressed", compressed)):
            params = [{"temperature": 1.0, **stop, "sampling_seed": (args.seed * 1_000_003 + k) % (2**31),
                       "custom_params": request_params(compression)} for k in range(len(ids))]
            before = len(stats.read_text().splitlines()) if stats.exists() else 0
            start = time.perf_counter()
            outs = engine.generate(input_ids=ids, sampling_params=params)
            wall = time.perf_counter() - start
            lines = [json.loads(x) for x in stats.read_text().splitlines()[before:]] if stats.exists() else []
            rows.append({"workload": workload, "mode": mode, **_mode_row(outs, wall, lines)})
            print(f"# {workload} {mode}: {wall:.1f} s", flush=True)
    finally:
        engine.shutdown()
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from sglang_ext import cpu_compat

    cpu_compat.apply()
    workdir = Path(tempfile.mkdtemp(prefix="bench-tail-"))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"pool {args.pool} tokens, compressed = rkv B={args.budget} W={args.buffer} alpha={args.window}; "
          f"smollm2: {args.groups} GSM8K prompts x {args.n}, max_new {args.max_new}; geometric: {args.tiny_groups} "
          f"prompts x {args.n}, {args.eos_tokens}/{TINY_VOCAB} EOS ids, max_new {args.tiny_max_new}", flush=True)
    rows = [r for w in args.workloads for r in run_workload(args, w, workdir)]
    header = ("workload", "mode", "responses", "p50 / p90 / max len", "idle row-steps (lockstep)",
              "idle row-time (engine)", "p50 / p90 finish s", "makespan s", "makespan / p50 finish", "tok/s",
              "max running")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['workload']} | {r['mode']} | {r['responses']} | {r['p50_len']:.0f} / {r['p90_len']:.0f} / "
              f"{r['max_len']} | {100 * r['idle_lockstep']:.1f}% | {100 * r['idle_time']:.1f}% | "
              f"{r['p50_finish_s']:.1f} / {r['p90_finish_s']:.1f} | {r['makespan_s']:.1f} | "
              f"{r['makespan_s'] / r['p50_finish_s']:.2f} | {r['tok_s']:.0f} | {r['max_running']} |")
    print(json.dumps([{k: v for k, v in r.items() if k != "lengths"} for r in rows]))


if __name__ == "__main__":
    main()
