"""Periodic held-out evaluation of the live policy, under dense AND sparse inference, on every engine.

Each data set's problems are shared out over the run's engines (equal counts; problem i is sampled as group i,
so the result does not depend on the number of engines), each engine's rank samples and verifies its share with
the ``eval`` package's ``sample_problems`` on a view of its engine (same live weights; the mode's KV compression,
``mode_compression``), and every rank gets every
problem's records, from which the metrics are computed (``benchmark_section``; rank 0 writes them). Metrics
``eval/<mode>/accuracy`` (mean avg@n over the data sets), ``eval/<mode>/<dataset>/accuracy`` (and per class of
problems, ``eval/subsets.py``), ``eval/<mode>/shortcut_free_accuracy`` (for tasks that flag the records whose
answer cannot be copied from the prompt: the mean over those data sets, and per data set),
``eval/<mode>/full_chain_frac`` (for chain tasks: the share of responses whose every intermediate state is right;
the mean over those data sets, and per data set),
``eval/<mode>/no_answer_frac``, ``eval/<mode>/truncated_frac`` and, for the compressed modes, ``eval/<mode>/budget``
(the budget it sampled with) go next to the training curves; the per-sample results go to
``run_dir/eval/step_<k>.<mode>.json``.

With the adaptive KV budget (``rollout.adaptive_budget``) the ``sparse`` mode keeps its stated budget
(``eval.compression``, else ``rollout.compression.budget``, the controller's start), so evaluations at different
steps, and of runs whose budgets moved differently, are comparable; the ``adaptive`` mode (opt-in, ``eval.modes``)
samples at the controller's current budget, the one the next step's rollouts use.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING
from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.eval.config import BenchmarkSettings, EvalConfig
from sparse_rl_megatron.eval.runner import benchmark_section, sample_problems
from sparse_rl_megatron.eval.subsets import full_chain_metrics, shortcut_free_metrics, subset_metrics
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.rollout.work_split import split_groups
from sparse_rl_megatron.trainer.engine_pool.pool import EnginePool
from sparse_rl_megatron.trainer.runtime import distributed as D

if TYPE_CHECKING:
    from sparse_rl_megatron.data.loader import Dataset
    from sparse_rl_megatron.trainer.config import TrainConfig

EVAL_DIR = "eval"


def metric_name(dataset: str) -> str:
    """A data set name usable inside a metric key (``task:modchain`` -> ``modchain``, a path -> its stem)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset.split(":")[-1].rsplit("/", 1)[-1])


def sparse_compression(cfg: "TrainConfig"):
    """The KV compression of the ``sparse`` mode: ``eval.compression``, else the rollout's as configured (with the
    adaptive budget: its start budget, not the controller's current one)."""
    return cfg.eval.compression or cfg.rollout.compression


def mode_compression(cfg: "TrainConfig", mode: str, controller_budget: int | None = None):
    """The KV compression evaluation ``mode`` samples with: none (``dense``), ``sparse_compression`` (``sparse``),
    or the rollout's compression at ``controller_budget``, the adaptive budget controller's current budget
    (``adaptive``)."""
    if mode == "dense":
        return CompressionConfig()
    if mode == "sparse":
        return sparse_compression(cfg)
    if mode == "adaptive":
        if controller_budget is None:
            raise ValueError("evaluation mode 'adaptive' needs the adaptive budget controller's budget")
        return cfg.rollout.budget_compression(controller_budget)
    raise ValueError(f"unknown evaluation mode '{mode}'")


def modes(cfg: "TrainConfig", controller_budget: int | None = None) -> list[str]:
    """The evaluation modes that apply: ``sparse`` is dropped when its compression is dense, ``adaptive`` when
    there is no controller budget (a saved model evaluated outside its training run)."""
    return [m for m in cfg.eval.modes if not (m == "sparse" and sparse_compression(cfg).is_dense)
            and not (m == "adaptive" and controller_budget is None)]


def evaluate(engine, reward, datasets: dict[str, "Dataset"], cfg: "TrainConfig", template: str, step: int,
             run_dir: str | Path) -> dict[str, float]:
    """Evaluate one engine's current weights (rank 0's; None elsewhere) on ``datasets`` in every mode."""
    with EnginePool.single(engine, reward, cfg.rollout.engine) as pool:
        return evaluate_pool(pool, datasets, cfg, template, step, run_dir)


def evaluate_pool(pool: "EnginePool", datasets: dict[str, "Dataset"], cfg: "TrainConfig", template: str, step: int,
                  run_dir: str | Path, controller_budget: int | None = None) -> dict[str, float]:
    """Evaluate the live weights of every engine of ``pool`` on its share of ``datasets``, in every mode; returns
    ``eval/*`` metrics on every rank. ``controller_budget``: the adaptive budget controller's current budget (the
    ``adaptive`` mode's; None: that mode is skipped). Collective."""
    settings = BenchmarkSettings(n=cfg.eval.n, max_new_tokens=cfg.eval.max_new_tokens
                                 or cfg.rollout.sampling.max_new_tokens)
    out_dir = Path(run_dir) / EVAL_DIR
    if D.is_main():
        out_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    for mode in modes(cfg, controller_budget):
        compression = mode_compression(cfg, mode, controller_budget)
        econf = EvalConfig(model=f"live policy at step {step}", benchmarks=list(datasets), template=template,
                           compression=compression, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
                           default=settings, seed=cfg.seed, show_progress=cfg.log.progress)
        sections, free_accs, chain_fracs = {}, [], []
        for name, dataset in datasets.items():
            shares = split_groups([1.0] * len(dataset), pool.layout.num_engines)

            def work(engine, slot, name=name, dataset=dataset, shares=shares):
                view = engine.with_compression(compression)
                one = pool.layout.num_engines == 1  # one engine: the plain call (any engine takes it)
                return sample_problems(name, dataset, view, pool.reward, econf, None if one else shares[slot.index])

            parts = pool.on_engines(work, f"evaluating {name} ({mode}) at step {step}")
            problems = [None] * len(dataset)
            for share, (records, _) in zip(shares, parts):
                for i, record in zip(share, records):
                    problems[i] = record
            seconds = {key: max(sec[key] for _, sec in parts) for key in ("generate", "verify")}
            sections[name] = benchmark_section(name, dataset, problems, econf, seconds)
            acc = sections[name]["metrics"][f"avg@{settings.n}"]
            prefix = MN.eval_key(mode, metric_name(name))
            metrics[MN.eval_key(mode, metric_name(name), MN.ACCURACY)] = acc
            metrics[MN.eval_key(mode, metric_name(name), MN.RESPONSE_LEN)] = \
                sections[name]["metrics"]["mean_response_tokens"]
            metrics.update(subset_metrics(prefix, dataset, sections[name]))
            free = shortcut_free_metrics(prefix, dataset, sections[name])
            metrics.update(free)
            free_accs += [v for k, v in free.items() if k.endswith("/" + MN.SHORTCUT_FREE_ACCURACY)]
            chains = full_chain_metrics(prefix, dataset, sections[name])
            metrics.update(chains)
            chain_fracs += list(chains.values())
        accs = [s["metrics"][f"avg@{settings.n}"] for s in sections.values()]
        metrics[MN.eval_key(mode, MN.ACCURACY)] = sum(accs) / len(accs)
        if free_accs:
            metrics[MN.eval_key(mode, MN.SHORTCUT_FREE_ACCURACY)] = sum(free_accs) / len(free_accs)
        if chain_fracs:
            metrics[MN.eval_key(mode, MN.FULL_CHAIN_FRAC)] = sum(chain_fracs) / len(chain_fracs)
        done = [s["metrics"] for s in sections.values()]  # collapse signs: no answer, or cut at max_new_tokens
        count = sum(m["samples"] for m in done)
        metrics[MN.eval_key(mode, MN.NO_ANSWER_FRAC)] = sum(m["reasons"]["no_answer"] for m in done) / count
        metrics[MN.eval_key(mode, MN.TRUNCATED_FRAC)] = \
            sum(m["truncated_fraction"] * m["samples"] for m in done) / count
        if not compression.is_dense:
            metrics[MN.eval_key(mode, MN.BUDGET)] = compression.budget
        if D.is_main():
            record = {"step": step, "mode": mode, "compression": compression.describe(), "benchmarks": sections}
            (out_dir / f"step_{step}.{mode}.json").write_text(json.dumps(record, indent=1) + "\n")
    metrics[MN.TIME_EVAL_S] = time.perf_counter() - t0
    return metrics
