"""Run an evaluation: for each benchmark, sample through a rollout engine, verify, and compute metrics.

The result is a JSON-ready dict (``results.py`` describes it) with every sample's answer and verdict.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparse_rl_megatron.compression.schedule import CompressionSchedule
from sparse_rl_megatron.data.loader import Dataset
from sparse_rl_megatron.data.sets import load_dataset
from sparse_rl_megatron.data.templates import TEMPLATES, render_prompt
from sparse_rl_megatron.eval.config import EvalConfig
from sparse_rl_megatron.eval.lengths import context_error, dense_prompts, prompt_token_counts
from sparse_rl_megatron.eval.metrics import avg_at_k, default_ks, mean_pass_at_k
from sparse_rl_megatron.eval.model_source import resolve_hf_model
from sparse_rl_megatron.eval.results import FORMAT_VERSION
from sparse_rl_megatron.eval.subsets import full_chain_fraction, shortcut_free_accuracy
from sparse_rl_megatron.rewards.reward import MathReward, reason_counts
from sparse_rl_megatron.rewards.verify import REASONS, Verdict
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.engine_registry import ENGINES
from sparse_rl_megatron.tasks import HELDOUT_SEED, get_task, is_task_ref
from sparse_rl_megatron.utils.errors import UsageError, UserError
from sparse_rl_megatron.utils.file_checks import read_json_file

if TYPE_CHECKING:
    from sparse_rl_megatron.rollout.engine_protocol import RolloutEngine

log = logging.getLogger(__name__)


def benchmark_metrics(correct: list[list[bool]], samples: list[dict], ks: list[int] | None) -> dict[str, Any]:
    """avg@n, pass@k (k <= n), reasons and response statistics of one benchmark.

    ``correct[p]``: the verdicts of problem p's n samples; ``samples``: the per-sample JSON records.
    """
    n = min(len(c) for c in correct)
    out: dict[str, Any] = {f"avg@{n}": avg_at_k(correct)}
    for k in sorted(set(ks if ks is not None else default_ks(n))):
        if k <= n:
            out[f"pass@{k}"] = mean_pass_at_k(correct, k)
    out["problems"] = len(correct)
    out["samples"] = len(samples)
    counts = Counter(s["reason"] for s in samples)
    out["reasons"] = {r: counts.get(r, 0) for r in REASONS}
    out["mean_response_tokens"] = sum(s["response_tokens"] for s in samples) / len(samples)
    out["truncated_fraction"] = sum(s["finish_reason"] == "length" for s in samples) / len(samples)
    out["mean_compression_events"] = sum(s["compression_events"] for s in samples) / len(samples)
    out["max_peak_kv_tokens"] = max(s["peak_kv_tokens"] for s in samples)
    return out


def _sample_record(sample, verdict: Verdict) -> dict[str, Any]:
    return {
        "index": sample.index_in_group,
        "response": sample.response_text,
        "answer": verdict.answer,
        "reward": verdict.reward,
        "reason": verdict.reason,
        "detail": verdict.detail,
        "finish_reason": sample.finish_reason,
        "response_tokens": sample.response_length,
        "compression_events": sample.compression.events,
        "peak_kv_tokens": sample.compression.peak_kv_tokens,
    }


def evaluate_benchmark(name: str, dataset: Dataset, engine: "RolloutEngine", reward: MathReward, config: EvalConfig
                       ) -> dict[str, Any]:
    """Sample ``n`` responses per problem, verify them, and return the benchmark's JSON section."""
    problems, seconds = sample_problems(name, dataset, engine, reward, config)
    return benchmark_section(name, dataset, problems, config, seconds)


def sample_problems(name: str, dataset: Dataset, engine: "RolloutEngine", reward: MathReward, config: EvalConfig,
                    indices: list[int] | None = None) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Sample and verify the problems ``indices`` of ``dataset`` (default: all); returns their JSON records, in
    that order, and the seconds spent generating and verifying. With ``indices`` the engine samples problem i as
    GRPO group i (its seed), so shares evaluated on several engines give the samples of one whole evaluation."""
    settings = config.settings(name)
    rows = list(range(len(dataset))) if indices is None else list(indices)
    if not rows:
        return [], {"generate": 0.0, "verify": 0.0}
    prompts = [render_prompt(config.template, dataset[i].prompt, engine.tokenizer) for i in rows]
    sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p,
                              max_new_tokens=settings.max_new_tokens, seed=config.seed)
    start = time.perf_counter()
    samples = (engine.generate(prompts, settings.n, sampling) if indices is None
               else engine.generate(prompts, settings.n, sampling, group_ids=rows))
    generate_s = time.perf_counter() - start
    if len(samples) != len(rows) * settings.n:
        raise RuntimeError(f"{name}: engine returned {len(samples)} samples for {len(rows)} prompts x "
                           f"n={settings.n}")
    for s in samples:
        s.metadata.update(dataset[s.group_id].metadata())
    start = time.perf_counter()
    verdicts = reward.score_samples(samples)
    verify_s = time.perf_counter() - start
    log.debug("%s: %d problems sampled (%s)", name, len(rows), reason_counts(verdicts))
    problems = {i: {"source_id": dataset[i].source_id, "problem": dataset[i].prompt, "gold": dataset[i].answer,
                    "answer_style": dataset[i].answer_style, "samples": []} for i in rows}
    for s, v in zip(samples, verdicts):
        problems[s.group_id]["samples"].append(_sample_record(s, v))
    return [problems[i] for i in rows], {"generate": generate_s, "verify": verify_s}


def benchmark_section(name: str, dataset: Dataset, problems: list[dict[str, Any]], config: EvalConfig,
                      seconds: dict[str, float]) -> dict[str, Any]:
    """The benchmark's JSON section from every problem's records (``sample_problems``, in data-set order)."""
    settings = config.settings(name)
    correct = [[smp["reason"] == "correct" for smp in p["samples"]] for p in problems]
    for p, c in zip(problems, correct):
        p["correct"] = sum(c)
    flat = [smp for p in problems for smp in p["samples"]]
    metrics = benchmark_metrics(correct, flat, config.pass_k)
    free = shortcut_free_accuracy(dataset, problems)
    if free is not None:  # a task that flags the records whose answer is not in the prompt (tasks/audit.py)
        metrics["shortcut_free_accuracy"], metrics["shortcut_free_problems"] = free
    chains = full_chain_fraction(dataset, problems)
    if chains is not None:  # a chain task: the share of responses whose every intermediate state is right
        metrics["full_chain_frac"] = chains[0]
    log.info("%s: avg@%d = %.4f over %d problems", name, settings.n, metrics[f"avg@{settings.n}"], len(problems))
    return {
        "dataset": name,
        "path": dataset.path,
        "n": settings.n,
        "max_new_tokens": settings.max_new_tokens,
        "skipped_rows": len(dataset.skipped),
        "metrics": metrics,
        "seconds": dict(seconds),
        "problems": problems,
    }


def check_lengths(config: EvalConfig, datasets: dict[str, Dataset], tokenizer, context: int | None) -> None:
    """Before the model loads: refuse benchmarks whose longest prompt + ``max_new_tokens`` overflow the model's
    ``context`` (None: not known), and warn about prompts that can never compress in a compressed mode."""
    schedule = CompressionSchedule(config.compression)
    c = config.compression
    overflows = []
    for name, dataset in datasets.items():
        max_new = config.settings(name).max_new_tokens
        lengths = prompt_token_counts([render_prompt(config.template, r.prompt, tokenizer) for r in dataset],
                                      tokenizer)
        if context is not None and context_error(name, max(lengths), max_new, context):
            overflows.append((max(lengths), name, max_new))
        dense = dense_prompts(schedule, lengths, max_new) if schedule.enabled else 0  # dense mode: nothing to say
        if dense:
            log.warning("%s: KV compression never runs for %d of %d prompts: prompt + %d new tokens stays below "
                        "B + W = %d (budget %d + buffer %d, scope %s), so %s on the full KV cache; raise "
                        "--max-new-tokens or lower --budget / --buffer", name, dense, len(lengths), max_new,
                        c.max_candidates, c.budget, c.buffer, c.scope,
                        "every sample decodes" if dense == len(lengths) else "their samples decode")
    if overflows:
        longest, name, max_new = max(overflows)
        others = sorted(n for _, n, _ in overflows if n != name)
        raise UsageError(context_error(name, longest, max_new, context)
                        + (f"; {', '.join(others)} overflow too" if others else ""))


def load_benchmark(name: str, config: EvalConfig) -> Dataset:
    """A named set or data file, or ``task:<name>``: the held-out split of a task built in code, drawn with the
    seed the trainer evaluates with (so its records, and which of them are shortcut-free, are the training run's)."""
    if is_task_ref(name):
        return get_task(name).records("heldout", limit=config.limit, seed=HELDOUT_SEED)
    return load_dataset(name, root=config.data_root, limit=config.limit, input_key=config.input_key,
                        label_key=config.label_key)


def _load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"no tokenizer could be loaded from {path} ({err}); pass --tokenizer DIR") from None


def run_eval(config: EvalConfig, *, export_dir: str | None = None, engine=None) -> dict[str, Any]:
    """Evaluate ``config.model`` on every benchmark; returns the results dict (see ``results.py``).

    ``engine``: an already built engine (tests, or a trainer evaluating its live policy); by default one
    is built by name (``config.engine``) from the model directory, once the lengths fit (``check_lengths``).
    """
    TEMPLATES.check(config.template, field="EvalConfig.template")
    datasets = {name: load_benchmark(name, config) for name in config.benchmarks}
    hf_dir, exported = None, False
    if engine is None:
        spec = ENGINES.get(config.engine)
        hf_dir = resolve_hf_model(config.model, export_dir)
        exported = Path(hf_dir) != Path(config.model) and export_dir is None
        try:
            hf_config = read_json_file(Path(hf_dir) / "config.json", "model config")
            check_lengths(config, datasets, _load_tokenizer(config.tokenizer or hf_dir),
                          hf_config.get("max_position_embeddings"))
            log.info("loading %s into the %s engine (%s, %s)", hf_dir, config.engine, config.dtype, config.mode())
            engine = spec.make(config.engine_build(hf_dir))
        finally:
            if exported:  # the weights are loaded: the temporary export is no longer needed
                shutil.rmtree(hf_dir, ignore_errors=True)
    elif engine.tokenizer is not None:
        check_lengths(config, datasets, engine.tokenizer, None)
    results: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "meta": {
            "model": str(config.model),
            "hf_model": str(hf_dir) if hf_dir is not None and not exported else None,
            "engine": config.engine,
            "mode": config.mode(),
            "compression": dataclasses.asdict(config.compression),
            "template": config.template,
            "temperature": config.temperature,
            "top_p": config.top_p,
            "seed": config.seed,
            "dtype": config.dtype,
            "verifier": dataclasses.asdict(config.verifier),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "benchmarks": {},
    }
    log.info("starting %d answer-checking worker(s)", config.verifier.num_workers)
    with MathReward(config.verifier) as reward:
        for name, dataset in datasets.items():
            settings = config.settings(name)
            log.info("%s: sampling %d problems x n=%d, up to %d new tokens (%s)", name, len(dataset), settings.n,
                     settings.max_new_tokens, config.mode())
            results["benchmarks"][name] = evaluate_benchmark(name, dataset, engine, reward, config)
    return results
