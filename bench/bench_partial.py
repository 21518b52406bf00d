"""Synchronous vs partial rollouts (``rollout.partial``, issue 54), side by side in one run, on the reference engine or
on SGLang's CPU engine with the sparse_kv plugin at a fixed KV pool (``--engine sglang --pool TOKENS``).

Each mode samples the same steps (``--prompts`` GRPO groups of ``--n`` samples per step) on the same engine and
weights (no learning between steps: the weight version is stamped, as a weight sync would, so staleness counts are
real), dense and compressed, the two modes' steps interleaved (a drift in the machine's load reaches both alike), and
prints per mode the mean step makespan (wall seconds of the step's rollout: what a training step waits for), rollout
tokens per second (tokens sampled in the step / makespan) and the ratios of partial against synchronous measured in
the same run; also the partial mode's groups dropped for staleness, and the mean and 99th percentile of |log rho|
(full attention over the sampler, same weights): what compression, and the re-prefill of a continued response, changed
in what the sampler saw.

Workloads:
  geometric (default): a tiny random Qwen2 whose EOS set is ``--eos-tokens`` tokens of its near-uniform vocabulary,
      so response lengths are geometric (mean ~ vocab / eos tokens), cut at ``--max-new``: the long tail of a
      reasoning workload, where a few responses run many times the median;
  --model DIR: an HF model directory (e.g. SmolLM2-135M-Instruct converted by ``sparse-rl convert gguf-to-hf``) on
      GSM8K test prompts from ``../shared/data`` (its chat template), EOS as the model's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_partial.py                 # geometric, 4 measured steps
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_partial.py --model .pytest_cache/d/realmodel/smollm2-135m-instruct
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_partial.py --engine sglang --pool 8192    # the plugin, fixed pool

On ``--engine sglang`` both KV modes run on one server (its pool ``--pool`` tokens, its compression the R-KV one;
the dense mode's requests carry ``method: none``, as ``CompressionView`` sends them), so at one pool the compressed
mode admits more requests at once; |log rho| is then the server's own full-attention prefill against the sampler.

Not a test: timings are wall clock on a shared machine; compare ratios within one run.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.rewards.exact import ExactReward
from sparse_rl_megatron.rollout.config import PartialRolloutConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.trainer.engine_pool.pool import EnginePool
from sparse_rl_megatron.trainer.partial_rollouts import PartialRollouts
from sparse_rl_megatron.trainer.step import rollout_samples

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "partial")


def _geometric_model(args, workdir: Path) -> Path:
    """The geometric workload's tiny random Qwen2 as an HF directory, its last ``--eos-tokens`` ids all EOS."""
    from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model("qwen2", init_std=0.002, seed=0, max_position_embeddings=args.max_new + 128)
    vocab = model.config.vocab_size
    eos = list(range(vocab - args.eos_tokens, vocab))
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(workdir)
    build_tiny_tokenizer(vocab).save_pretrained(workdir)
    return workdir


def _engine(args, model_dir: Path, compression: CompressionConfig):
    """The engine both modes sample on: the reference engine, or an in-process SGLang server with the plugin at
    ``--pool`` tokens whose own compression is ``compression``."""
    if args.engine == "hf":
        return HFRolloutEngine(str(model_dir), show_progress=False, max_batch_size=1024)
    from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    return SGLangRolloutEngine(SGLangEngineConfig(model_path=str(model_dir), compression=compression, dtype="float32",
                                                  max_total_tokens=args.pool, max_running_requests=args.max_running,
                                                  random_seed=args.seed, log_level="error"))


def _records(args) -> tuple[list[MathRecord], str]:
    if args.model is None:
        return [MathRecord(prompt=f"Problem {i}: add {i} and {2 * i}.", answer=str(3 * i), source_id=f"L{i}",
                           dataset="geometric") for i in range(4096)], "raw"
    from sparse_rl_megatron.data.sets import load_dataset

    return list(load_dataset("gsm8k")), "tokenizer"


def _stamp(dense, engine, version: int, model_dir: Path, args) -> None:
    """Weight version ``version`` (the same weights), as a step's weight sync would leave it: the reference engine's
    stamp is set; the SGLang server reloads its weights from disk (flushing its caches) and stamps every token."""
    if args.engine == "sglang":
        if version != dense.weight_version:
            dense.update_weights_from_disk(str(model_dir), version)
    else:
        engine.weight_version = version


def _side_by_side(engine, records, template, compression, model_dir: Path, args) -> dict[str, dict[str, float]]:
    """Synchronous and partial rollouts of one KV mode, their steps interleaved (sync step k, then partial step k,
    at the same weight version) so a drift in the machine's load reaches both modes alike."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new)
    dense = engine
    engine = engine.with_compression(compression)
    state = PartialRollouts(PartialRolloutConfig(enabled=True, extra_groups=args.extra, segment_tokens=args.segment,
                                                 max_staleness=args.staleness), args.prompts, args.n)
    orders = {mode: list(records) for mode in MODES}   # each mode draws the same problems in the same order
    rows = {mode: {"spans": [], "tokens": [], "lengths": [], "carried": [], "dropped": [], "gaps": []}
            for mode in MODES}
    base = dense.weight_version
    with EnginePool.single(engine, ExactReward(), args.engine) as pool:
        for step in range(1, args.steps + 2):     # step 1 warms up (and fills the partial pipeline)
            version = base + step - 1            # the SGLang server's versions only grow: this run's start at base
            _stamp(dense, engine, version, model_dir, args)
            for mode in MODES:
                order, row = orders[mode], rows[mode]
                take = lambda k, order=order: [order.pop(0) for _ in range(k)]  # noqa: E731
                t0 = time.perf_counter()
                if mode == "partial":
                    batch, m = state.step(pool, take, template, sampling, seed=args.seed, step=version + 1)
                    sampled = m[MN.THROUGHPUT_ROLLOUT_TOKENS_PER_S] * m[MN.TIME_ROLLOUT_S]
                    row["carried"].append(m[MN.PARTIAL_CARRIED_REQUESTS])
                    row["dropped"].append(m[MN.PARTIAL_DROPPED_GROUPS])
                else:
                    batch, m = rollout_samples(pool, take(args.prompts), template, args.n, sampling, args.seed,
                                               version + 1)
                    sampled = sum(s.response_length for s in batch)
                span = time.perf_counter() - t0
                if step == 1:
                    continue
                row["spans"].append(span)
                row["tokens"].append(sampled)
                row["lengths"] += [s.response_length for s in batch]
                # what the sampler saw against full attention (same weights): log pi_dense - log pi_sampler per token
                ref = dense.dense_logprobs([s.prompt_ids for s in batch], [s.response_ids for s in batch])
                row["gaps"] += [float(x) for s, r in zip(batch, ref) for x in (r - s.sampler_logprobs).abs()]
    return {mode: _summary(row) for mode, row in rows.items()}


def _summary(row: dict[str, list]) -> dict[str, float]:
    lengths, gaps = sorted(row["lengths"]), sorted(row["gaps"])
    return {"makespan_s": statistics.mean(row["spans"]), "tok_per_s": sum(row["tokens"]) / sum(row["spans"]),
            "p50": lengths[len(lengths) // 2], "p90": lengths[int(0.9 * len(lengths))], "max": lengths[-1],
            "carried": statistics.mean(row["carried"]) if row["carried"] else 0.0, "dropped": sum(row["dropped"]),
            "gap": statistics.mean(gaps), "gap_p99": gaps[int(0.99 * len(gaps))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF model directory (default: the geometric tiny workload)")
    ap.add_argument("--engine", choices=("hf", "sglang"), default="hf",
                    help="hf: the reference engine; sglang: SGLang's CPU engine with the plugin")
    ap.add_argument("--pool", type=int, default=8192, help="sglang: the KV pool in tokens (both modes)")
    ap.add_argument("--max-running", type=int, default=128, help="sglang: max_running_requests")
    ap.add_argument("--prompts", type=int, default=8, help="GRPO groups per step")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--eos-tokens", type=int, default=6, help="geometric workload: EOS set size")
    ap.add_argument("--segment", type=int, default=48, help="rollout.partial.segment_tokens")
    ap.add_argument("--extra", type=int, default=4, help="rollout.partial.extra_groups")
    ap.add_argument("--staleness", type=int, default=4, help="rollout.partial.max_staleness")
    ap.add_argument("--steps", type=int, default=4, help="measured steps (after one warm-up step)")
    ap.add_argument("--budget", type=int, default=32, help="compressed mode: R-KV budget B (window 4, buffer 8)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    records, template = _records(args)
    workdir = Path(tempfile.mkdtemp(prefix="bench-partial-"))
    model_dir = Path(args.model) if args.model else _geometric_model(args, workdir / "tiny")
    workload = model_dir.name if args.model else f"geometric (EOS {args.eos_tokens} tokens)"
    rkv = CompressionConfig(method="rkv", budget=args.budget, window=4, buffer=8)
    where = f"sglang + plugin, pool {args.pool} tokens" if args.engine == "sglang" else "hf reference engine"
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread; {where}; workload "
          f"{workload}; {args.prompts} groups x {args.n}, max_new {args.max_new}; partial: segment {args.segment}, "
          f"extra {args.extra}, max staleness {args.staleness}; {args.steps} measured steps")
    engine = _engine(args, model_dir, rkv)
    print("| KV | mode | p50 / p90 / max len | step makespan s | rollout tok/s | carried | dropped groups | "
          "mean / p99 abs log rho | makespan x | tok/s x |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    try:
        for kv, compression in (("dense", CompressionConfig()), (f"rkv B={args.budget}", rkv)):
            result = _side_by_side(engine, records, template, compression, model_dir, args)
            sync = result["sync"]
            for mode, r in result.items():
                print(f"| {kv} | {mode} | {r['p50']} / {r['p90']} / {r['max']} | {r['makespan_s']:.2f} | "
                      f"{r['tok_per_s']:.0f} | {r['carried']:.1f} | {r['dropped']} | {r['gap']:.4f} / "
                      f"{r['gap_p99']:.3f} | {sync['makespan_s'] / r['makespan_s']:.2f} | "
                      f"{r['tok_per_s'] / sync['tok_per_s']:.2f} |", flush=True)
    finally:
        if args.engine == "sglang":
            engine.shutdown()


if __name__ == "__main__":
    main()
