"""Periodic held-out evaluation of the live policy, under dense AND sparse inference (rank 0).

Runs the ``eval`` package's ``evaluate_benchmark`` on views of the rollout engine (same live weights, KV
compression off for ``dense``; ``eval.compression``, else the rollout's compression, for ``sparse``). Metrics
``eval/<mode>/accuracy`` (mean avg@n over the data sets), ``eval/<mode>/<dataset>/accuracy`` (and per class of
problems, ``eval/subsets.py``), ``eval/<mode>/no_answer_frac`` and ``eval/<mode>/truncated_frac`` go next to the
training curves; the per-sample results go to ``run_dir/eval/step_<k>.<mode>.json``.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparse_rl_megatron.data.loader import Dataset
    from sparse_rl_megatron.trainer.config import TrainConfig

EVAL_DIR = "eval"


def metric_name(dataset: str) -> str:
    """A data set name usable inside a metric key (``task:modchain`` -> ``modchain``, a path -> its stem)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset.split(":")[-1].rsplit("/", 1)[-1])


def sparse_compression(cfg: "TrainConfig"):
    """The KV compression of the ``sparse`` mode: ``eval.compression``, else the rollout's."""
    return cfg.eval.compression or cfg.rollout.compression


def modes(cfg: "TrainConfig") -> list[str]:
    """The evaluation modes that apply (``sparse`` is dropped when its compression is dense)."""
    return [m for m in cfg.eval.modes if not (m == "sparse" and sparse_compression(cfg).is_dense)]


def evaluate(engine, spec, reward, datasets: dict[str, "Dataset"], cfg: "TrainConfig", template: str, step: int,
             run_dir: str | Path) -> dict[str, float]:
    """Evaluate the engine's current weights on ``datasets`` in every mode; returns ``eval/*`` metrics."""
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.eval.config import BenchmarkSettings, EvalConfig
    from sparse_rl_megatron.eval.runner import evaluate_benchmark
    from sparse_rl_megatron.eval.subsets import subset_metrics

    settings = BenchmarkSettings(n=cfg.eval.n, max_new_tokens=cfg.eval.max_new_tokens
                                 or cfg.rollout.sampling.max_new_tokens)
    out_dir = Path(run_dir) / EVAL_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    for mode in modes(cfg):
        compression = CompressionConfig() if mode == "dense" else sparse_compression(cfg)
        econf = EvalConfig(model=f"live policy at step {step}", benchmarks=list(datasets), template=template,
                           compression=compression, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
                           default=settings, seed=cfg.seed, show_progress=cfg.log.progress)
        view = spec.with_compression(engine, compression)
        sections = {}
        for name, dataset in datasets.items():
            sections[name] = evaluate_benchmark(name, dataset, view, reward, econf)
            acc = sections[name]["metrics"][f"avg@{settings.n}"]
            metrics[f"eval/{mode}/{metric_name(name)}/accuracy"] = acc
            metrics[f"eval/{mode}/{metric_name(name)}/response_len"] = sections[name]["metrics"]["mean_response_tokens"]
            metrics.update(subset_metrics(f"eval/{mode}/{metric_name(name)}", dataset, sections[name]))
        accs = [s["metrics"][f"avg@{settings.n}"] for s in sections.values()]
        metrics[f"eval/{mode}/accuracy"] = sum(accs) / len(accs)
        done = [s["metrics"] for s in sections.values()]  # collapse signs: no answer, or cut at max_new_tokens
        count = sum(m["samples"] for m in done)
        metrics[f"eval/{mode}/no_answer_frac"] = sum(m["reasons"]["no_answer"] for m in done) / count
        metrics[f"eval/{mode}/truncated_frac"] = sum(m["truncated_fraction"] * m["samples"] for m in done) / count
        record = {"step": step, "mode": mode, "compression": compression.describe(), "benchmarks": sections}
        (out_dir / f"step_{step}.{mode}.json").write_text(json.dumps(record, indent=1) + "\n")
    metrics["time/eval_s"] = time.perf_counter() - t0
    return metrics
