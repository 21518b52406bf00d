"""The experiment's results: per arm the final held-out accuracy (dense and sparse inference, mean and spread
over seeds; also on the shortcut-free records where the task flags them) and what the rollouts cost (KV tokens
per sequence, the mean budget) and how far off-policy they were (rejections, contamination, rho's tail).
Written as ``results.json`` and ``results.md`` in the experiment directory (with ``figure.png``, ``figure.py``)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from sparse_rl_megatron.experiment.arm_dirs import ARM_DONE, read_json, seed_dir
from sparse_rl_megatron.experiment.arms import ARMS, arm_runs
from sparse_rl_megatron.experiment.config import ExperimentConfig
from sparse_rl_megatron.experiment.figure import FIGURE_FILE, SWEEP_FIGURE_FILE, draw_figure
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.observability.metrics_writer import METRICS_FILE, read_metrics

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
STEP_MEANS = {
    "kv_ratio": MN.ROLLOUT_KV_RETAINED_FRAC,
    "kv_tokens_held": MN.ROLLOUT_KV_TOKENS_PEAK_MEAN,
    "rejected_seq_frac": MN.SPARSE_REJECTED_SEQ_FRAC,
    "vetoed_seq_frac": MN.SPARSE_VETOED_SEQ_FRAC,
    "rejected_token_frac": MN.SPARSE_REJECTED_TOKEN_FRAC,
    "clip_frac": MN.LOSS_CLIP_FRAC,
    "rho_p1": MN.SPARSE_RHO_P1,
    "rho_p5": MN.SPARSE_RHO_P5,
    "repetition_rate": MN.ROLLOUT_REPETITION_RATE,
    "reward": MN.ROLLOUT_REWARD_MEAN,
    "budget": MN.ROLLOUT_BUDGET_SAMPLED_MEAN,
    "contaminated_frac": MN.SPARSE_CONTAMINATED_FRAC,
}
"""Per-arm summaries that are the mean over the run's rollout steps."""
STEP_MAX = {"grad_norm_max": MN.TRAIN_GRAD_NORM_MAX}
STEP_MIN = {"rho_min": MN.SPARSE_RHO_MIN}


def run_maxima(records: dict[str, dict[int, list[dict]]], name: str = "grad_norm_max") -> dict[str, dict[int, float]]:
    """``{arm: {seed: the run's largest value of STEP_MAX[name]}}`` over its rollout steps (``seed_summary``'s
    ``name``: the "largest gradient norm of a run" the docs compare), the runs that logged it."""
    out: dict[str, dict[int, float]] = {}
    for arm, by_seed in records.items():
        for seed, recs in by_seed.items():
            largest = _step_extreme(recs, STEP_MAX[name], max)
            if largest is not None:
                out.setdefault(arm, {})[seed] = largest
    return out


def _step_extreme(records: list[dict], key: str, fn) -> float | None:
    """``fn`` (max or min) of ``key`` over a run's rollout steps; None when no step logged it."""
    vals = _values(records, key)
    return fn(vals) if vals else None


def arm_records(cfg: ExperimentConfig) -> dict[str, dict[int, list[dict]]]:
    """``{arm run name: {seed: metrics records}}`` of the complete arms (incomplete ones are left out)."""
    out: dict[str, dict[int, list[dict]]] = {}
    for run in arm_runs(cfg.experiment.arms, cfg.experiment.budgets):
        for seed in cfg.experiment.seeds:
            run_dir = seed_dir(cfg, seed) / run.name
            if (run_dir / ARM_DONE).is_file():
                out.setdefault(run.name, {})[seed] = read_metrics(run_dir / METRICS_FILE)
    return out


def _values(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if r.get(key) is not None and r["step"] > 0]


def _eval_at(records: list[dict], mode: str, last: bool, metric: str = MN.ACCURACY) -> float | None:
    key = MN.eval_key(mode, metric)
    evals = [r[key] for r in records if r.get(key) is not None]
    return (evals[-1] if last else evals[0]) if evals else None


def seed_summary(records: list[dict], done: dict) -> dict[str, float | None]:
    """One arm, one seed: accuracies before/after, step means, CPU seconds."""
    row: dict[str, float | None] = {
        "dense_acc": _eval_at(records, "dense", True), "sparse_acc": _eval_at(records, "sparse", True),
        "dense_acc_start": _eval_at(records, "dense", False), "sparse_acc_start": _eval_at(records, "sparse", False),
    }
    for mode in ("dense", "sparse"):  # the records no trivial policy answers (None: the task flags none)
        row[f"{mode}_free_start"] = _eval_at(records, mode, False, MN.SHORTCUT_FREE_ACCURACY)
        row[f"{mode}_free"] = _eval_at(records, mode, True, MN.SHORTCUT_FREE_ACCURACY)
    if len([r for r in records if r.get(MN.EVAL_DENSE_ACCURACY) is not None]) < 2:  # the control: final only
        row["dense_acc_start"] = row["sparse_acc_start"] = row["dense_free_start"] = row["sparse_free_start"] = None
    for name, key in STEP_MEANS.items():
        vals = _values(records, key)
        row[name] = sum(vals) / len(vals) if vals else None
    for table, fn in ((STEP_MAX, max), (STEP_MIN, min)):
        for name, key in table.items():
            row[name] = _step_extreme(records, key, fn)
    row["cpu_seconds"] = done.get("cpu_seconds")
    row["sft_steps"] = done.get("sft_steps")
    return row


def mean_spread(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None with fewer than 2 values) of the non-missing values."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def summarise(cfg: ExperimentConfig) -> dict:
    """``{"arms": {name: {"seeds": {seed: row}, "mean": row, "std": row}}}`` over the complete arms."""
    arms = {}
    for name, by_seed in arm_records(cfg).items():
        rows = {seed: seed_summary(recs, read_json(seed_dir(cfg, seed) / name / ARM_DONE, {}))
                for seed, recs in by_seed.items()}
        keys = next(iter(rows.values())).keys()
        stats = {k: mean_spread([r[k] for r in rows.values()]) for k in keys}
        arms[name] = {"seeds": rows, "mean": {k: m for k, (m, _) in stats.items()},
                      "std": {k: s for k, (_, s) in stats.items()}}
    return {"arms": arms, "seeds": cfg.experiment.seeds, "steps": cfg.train.steps}


def _fmt(mean: float | None, std: float | None, scale: float = 1.0, digits: int = 1) -> str:
    if mean is None:
        return "-"
    text = f"{mean * scale:.{digits}f}"
    return text + (f" ± {std * scale:.{digits}f}" if std is not None else "")


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def markdown_table(summary: dict) -> str:
    """The results table (accuracies in %, mean ± sample std over seeds; step means of the rollout metrics)."""
    head = ("| arm | seeds | dense acc start → final (%) | sparse acc start → final (%) | "
            "shortcut-free dense start → final (%) | shortcut-free sparse start → final (%) | KV held / dense | "
            "KV tokens / sequence | mean budget | contaminated seqs | "
            "rejected seqs | rejected tokens | clip ratio | rho p1 | rho min | repetition | max grad norm | CPU s |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name, arm in summary["arms"].items():
        m, s = arm["mean"], arm["std"]
        start_d, start_s = _fmt(m["dense_acc_start"], None, 100), _fmt(m["sparse_acc_start"], None, 100)
        lines.append(
            f"| {name} | {len(arm['seeds'])} | {start_d} → {_fmt(m['dense_acc'], s['dense_acc'], 100)} | "
            f"{start_s} → {_fmt(m['sparse_acc'], s['sparse_acc'], 100)} | "
            + " | ".join(f"{_fmt(m[f'{mode}_free_start'], None, 100)} → "
                         f"{_fmt(m[f'{mode}_free'], s[f'{mode}_free'], 100)}" for mode in ("dense", "sparse"))
            + f" | {_fmt(m['kv_ratio'], None, 1, 3)} | {_fmt(m['kv_tokens_held'], s['kv_tokens_held'])} | "
            f"{_fmt(m['budget'], s['budget'])} | {_fmt(m['contaminated_frac'], s['contaminated_frac'], 1, 3)} | "
            f"{_fmt(m['rejected_seq_frac'], s['rejected_seq_frac'], 1, 3)} | "
            f"{_fmt(m['rejected_token_frac'], None, 1, 3)} | {_sci(m['clip_frac'])} | {_sci(m['rho_p1'])} | "
            f"{_sci(m['rho_min'])} | {_fmt(m['repetition_rate'], None, 1, 3)} | "
            f"{_fmt(m['grad_norm_max'], None, 1, 2)} | "
            f"{_fmt(m['cpu_seconds'], None, 1, 0)} |")
    return "\n".join(lines) + "\n"


def sweep_table(cfg: ExperimentConfig, summary: dict) -> str:
    """Final accuracy (%) and rejected sequences of the sweepable arms per KV budget (the recipe's budget is the
    main arms')."""
    sweepable = [a for a in cfg.experiment.arms if ARMS.get(a).sweeps]
    budgets = sorted({cfg.train.rollout.compression.budget, *cfg.experiment.budgets})
    head = "| budget | " + " | ".join(f"{a} dense | {a} sparse | {a} rejected seqs" for a in sweepable) + " |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for b in budgets:
        cells = []
        for a in sweepable:
            arm = summary["arms"].get(a if b == cfg.train.rollout.compression.budget else f"{a}_B{b}")
            m, s = (arm["mean"], arm["std"]) if arm else ({}, {})
            cells += [_fmt(m.get("dense_acc"), s.get("dense_acc"), 100),
                      _fmt(m.get("sparse_acc"), s.get("sparse_acc"), 100), _fmt(m.get("rejected_seq_frac"), None, 1, 3)]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(cfg: ExperimentConfig) -> tuple[Path, Path | None]:
    """``results.json``, ``results.md`` and ``figure.png`` (the main arms; ``figure_sweep.png``: the budget sweep)
    of what is complete so far; with the analysis, ``figure_claims.png`` (the design's panels, the arms' budgets in
    the legend) and ``figure_tests.png`` (the registered tests as ``analysis.json`` holds them, and each run's
    largest gradient norm)."""
    out = Path(cfg.experiment.out)
    summary = summarise(cfg)
    (out / RESULTS_JSON).write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown_table(summary)
    records = arm_records(cfg)
    runs = [r for r in arm_runs(cfg.experiment.arms, cfg.experiment.budgets) if r.name in records]
    if cfg.experiment.budgets:
        text += "\nBudget sweep (final greedy held-out accuracy, %; sparse inference at the recipe's eval budget):\n\n"
        text += sweep_table(cfg, summary)
        sweep = {r.name: records[r.name] for r in runs if r.spec.sweeps}
        draw_figure(sweep, out / SWEEP_FIGURE_FILE, "budget sweep")
    (out / RESULTS_MD).write_text(text)
    main = {r.name: records[r.name] for r in runs if r.budget is None}
    figure = draw_figure(main, out / FIGURE_FILE, "arms")
    if main:  # the pre-registered analysis (issue 20) of whatever is complete
        from sparse_rl_megatron.experiment.analysis import ANALYSIS_JSON, DESIGNS
        from sparse_rl_megatron.experiment.analysis_report import write_full_analysis
        from sparse_rl_megatron.experiment.figure import (
            CLAIMS_FIGURE_FILE, TESTS_FIGURE_FILE, arm_labels, draw_tests_figure,
        )

        write_full_analysis(cfg, main)
        design = DESIGNS.get(cfg.experiment.analysis)
        panels, smooth, marks = design.panels, design.smoothed, {}
        if design.mark_adaptive_target:  # the adaptive arm's target beside the signal it held
            from sparse_rl_megatron.compression.budget_controller import SIGNALS

            controller = cfg.train.rollout.adaptive_budget
            metric = SIGNALS.get(controller.signal).metric
            marks = {title: (controller.target, f"adaptive target {controller.target:g} ({controller.signal})")
                     for title, key in panels.items() if key == metric}
        labels = arm_labels(main)
        draw_figure(main, out / CLAIMS_FIGURE_FILE, "arms", panels, marks, smooth, labels, design.offscale)
        tests = json.loads((out / ANALYSIS_JSON).read_text())["tests"]  # the verdicts as the analysis wrote them
        draw_tests_figure(tests, out / TESTS_FIGURE_FILE, run_maxima(main), labels,
                          f"seeds {', '.join(map(str, sorted({s for by_seed in main.values() for s in by_seed})))}")
    return out / RESULTS_MD, figure
