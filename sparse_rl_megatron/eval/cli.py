"""``sparse-rl eval``: a model on math benchmarks, dense or compressed-KV, through a rollout engine.

    sparse-rl eval --model MODEL_DIR [--benchmarks gsm8k,math500] [--compression rkv --budget 512]
                   [--n 4 --temperature 0.8 --top-p 0.95 --max-new-tokens 4096] [--output results.json]
    sparse-rl eval --compare dense.json sparse.json

Sampling defaults follow ``--preset paper`` (T = 0.8, top-p 0.95, 8192 tokens; AIME24 / AMC23 n = 32 at
16384 tokens); any flag given explicitly wins over the preset, for every benchmark.
"""
from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from sparse_rl_megatron.data.sets import BENCHMARKS

PRESETS = ("paper", "none")
_BUILTIN = {"temperature": 0.8, "top_p": 0.95, "n": 1, "max_new_tokens": 8192}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", help="HF model directory or Megatron checkpoint (exported to HF first)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--benchmarks", default="all",
                   help=f"comma-separated named sets or JSONL/Parquet files; 'all' = {','.join(BENCHMARKS)}")
    g.add_argument("--data-root", default=None, help="shared data folder (default ../shared/data or $SPARSE_RL_DATA)")
    g.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    g.add_argument("--input-key", default="prompt", help="prompt field of a benchmark given as a file")
    g.add_argument("--label-key", default="answer", help="gold-answer field of a benchmark given as a file")
    g.add_argument("--template", default="qwen25_chat", help="prompt template name")
    g.add_argument("--export-dir", default=None, help="where a Megatron checkpoint is exported to HF (default: temp)")

    g = parser.add_argument_group("engine and inference mode")
    g.add_argument("--engine", default="hf", help="rollout engine name: hf (reference) or sglang (SGLang + sparse_kv plugin)")
    g.add_argument("--compression", default="none", help="KV compressor: none (dense), rkv, snapkv, streamingllm, h2o")
    g.add_argument("--budget", type=int, default=512, help="KV budget B")
    g.add_argument("--window", type=int, default=8, help="observation window alpha")
    g.add_argument("--buffer", type=int, default=128, help="buffer W (compress at B + W)")
    g.add_argument("--scope", default="all", help="budget scope: all | response")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    g.add_argument("--max-batch-size", type=int, default=64)

    g = parser.add_argument_group("sampling")
    g.add_argument("--preset", default="paper", choices=PRESETS, help="sampling defaults (explicit flags win)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--n", type=int, default=None, help="samples per problem")
    g.add_argument("--bench", action="append", default=[], metavar="NAME:n=K,max_new_tokens=M",
                   help="per-benchmark n / max_new_tokens (repeatable)")
    g.add_argument("--pass-k", default=None, help="comma-separated k of pass@k (default 1, powers of 2, n)")
    g.add_argument("--seed", type=int, default=0)

    g = parser.add_argument_group("verification and output")
    g.add_argument("--verifier-workers", type=int, default=2)
    g.add_argument("--verifier-timeout", type=float, default=5.0, help="seconds per answer")
    g.add_argument("--output", default=None, help="results JSON (default eval-<model>-<mode>.json)")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="print two results files side by side and exit")


def _parse_bench_override(text: str) -> tuple[str, dict[str, int]]:
    m = re.fullmatch(r"([^:]+):(.+)", text)
    if not m:
        raise ValueError(f"--bench '{text}': expected NAME:n=K,max_new_tokens=M")
    fields: dict[str, int] = {}
    for part in m.group(2).split(","):
        key, _, value = part.partition("=")
        if key not in ("n", "max_new_tokens") or not value.isdigit():
            raise ValueError(f"--bench '{text}': '{part}' must be n=<int> or max_new_tokens=<int>")
        fields[key] = int(value)
    return m.group(1), fields


def build_config(args: argparse.Namespace):
    """The ``EvalConfig`` of the parsed arguments (preset, then explicit flags, then --bench entries)."""
    from sparse_rl_megatron.compression.config import CompressionConfig
    from sparse_rl_megatron.eval.config import PAPER_PRESET, BenchmarkSettings, EvalConfig
    from sparse_rl_megatron.rewards.pool import VerifierPoolConfig

    if not args.model:
        raise ValueError("--model is required (an HF model directory or a Megatron checkpoint), unless --compare")
    benchmarks = list(BENCHMARKS) if args.benchmarks == "all" else [b for b in args.benchmarks.split(",") if b]
    preset = PAPER_PRESET if args.preset == "paper" else {}

    def pick(name):
        explicit = getattr(args, name)
        if explicit is not None:
            return explicit
        if name in ("n", "max_new_tokens"):
            return getattr(preset.get("default", None), name, _BUILTIN[name])
        return preset.get(name, _BUILTIN[name])

    default = BenchmarkSettings(n=pick("n"), max_new_tokens=pick("max_new_tokens"))
    per_benchmark: dict[str, BenchmarkSettings] = {}
    for name, s in preset.get("per_benchmark", {}).items():
        if name in benchmarks:  # a flag given explicitly applies to every benchmark, preset ones included
            per_benchmark[name] = BenchmarkSettings(
                n=args.n if args.n is not None else s.n,
                max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None else s.max_new_tokens)
    for text in args.bench:
        name, fields = _parse_bench_override(text)
        base = per_benchmark.get(name, default)
        per_benchmark[name] = BenchmarkSettings(n=fields.get("n", base.n),
                                                max_new_tokens=fields.get("max_new_tokens", base.max_new_tokens))
    compression = CompressionConfig(method=args.compression, budget=args.budget, window=args.window,
                                    buffer=args.buffer, scope=args.scope)
    return EvalConfig(
        model=args.model, benchmarks=benchmarks, tokenizer=args.tokenizer, data_root=args.data_root,
        limit=args.limit, input_key=args.input_key, label_key=args.label_key, template=args.template,
        engine=args.engine, compression=compression,
        temperature=pick("temperature"), top_p=pick("top_p"), default=default, per_benchmark=per_benchmark,
        pass_k=[int(k) for k in args.pass_k.split(",")] if args.pass_k else None, seed=args.seed,
        dtype=args.dtype, max_batch_size=args.max_batch_size,
        verifier=VerifierPoolConfig(num_workers=args.verifier_workers, timeout_s=args.verifier_timeout),
        show_progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.eval.report import print_comparison, print_results
    from sparse_rl_megatron.eval.results import read_results, write_results

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.compare:
        a, b = (read_results(p) for p in args.compare)
        pa, pb = (Path(p) for p in args.compare)
        labels = (pa.stem, pb.stem) if pa.stem != pb.stem else (str(pa), str(pb))
        print_comparison(a, b, labels=labels)
        return 0
    import torch

    from sparse_rl_megatron.eval.engines import ENGINES
    from sparse_rl_megatron.eval.runner import run_eval

    config = build_config(args)
    ENGINES.check(config.engine, field="--engine")
    torch.manual_seed(config.seed)
    results = run_eval(config, export_dir=args.export_dir)
    output = args.output or f"eval-{Path(config.model.rstrip('/')).name}-{config.mode()}.json"
    path = write_results(results, output)
    print_results(results)
    print(f"results written to {path}")
    return 0
