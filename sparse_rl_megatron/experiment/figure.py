"""The experiment's figure: one panel per metric, one line per arm (mean over seeds, shaded min-max when
there are several), rollout step on the x axis. The supervised control has no rollouts: it appears as a
marker at the last step of the accuracy panels."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import textwrap
from pathlib import Path
from typing import Mapping, Sequence

from sparse_rl_megatron.observability import metric_names as MN

FIGURE_FILE = "figure.png"
SWEEP_FIGURE_FILE = "figure_sweep.png"
PANELS = {
    "train reward": MN.ROLLOUT_REWARD_MEAN,
    "held-out accuracy, dense inference": MN.EVAL_DENSE_ACCURACY,
    "held-out accuracy, sparse inference": MN.EVAL_SPARSE_ACCURACY,
    "grad norm": MN.TRAIN_GRAD_NORM,
    "rejected sequences": MN.SPARSE_REJECTED_SEQ_FRAC,
    "clip ratio": MN.LOSS_CLIP_FRAC,
    "rho p1": MN.SPARSE_RHO_P1,
    "rho p5": MN.SPARSE_RHO_P5,
    "repetition rate (repeated 4-grams)": MN.ROLLOUT_REPETITION_RATE,
    "KV tokens held per sequence (peak)": MN.ROLLOUT_KV_TOKENS_PEAK_MEAN,
}
LOG_PANELS = frozenset({"rho p1", "rho p5", "grad norm (log scale)"})
CLAIMS_FIGURE_FILE = "figure_claims.png"
CLAIM_PANELS = {
    "held-out accuracy, dense inference": MN.EVAL_DENSE_ACCURACY,
    "held-out accuracy, sparse inference": MN.EVAL_SPARSE_ACCURACY,
    "class odd_x_stop, dense (learning)": MN.EVAL_DENSE_MODCHAIN_WEAK_ODD_X_STOP_ACCURACY,
    "rest, dense (damage)": MN.EVAL_DENSE_MODCHAIN_WEAK_REST_ACCURACY,
    "train reward": MN.ROLLOUT_REWARD_MEAN,
    "would-be veto (rho < 1e-4)": MN.SPARSE_WOULD_VETO_FRAC,
    "T=1 entropy of the sampler (nats/token)": MN.SPARSE_ENTROPY_SAMPLER,
    "grad norm (log scale)": MN.TRAIN_GRAD_NORM,
}
"""Panels of the issue-20 figure (``figure_claims.png``)."""
CLAIM_PANELS_ADAPTIVE = {
    "shortcut-free accuracy, dense inference": MN.EVAL_DENSE_SHORTCUT_FREE_ACCURACY,
    "shortcut-free accuracy, sparse inference": MN.EVAL_SPARSE_SHORTCUT_FREE_ACCURACY,
    "KV budget sampled with": MN.ROLLOUT_BUDGET_SAMPLED_MEAN,
    "contaminated sequences (any rho < 0.5)": MN.SPARSE_CONTAMINATED_FRAC,
    "KV tokens held per sequence (peak)": MN.ROLLOUT_KV_TOKENS_PEAK_MEAN,
    "train reward": MN.ROLLOUT_REWARD_MEAN,
}
"""Panels of the issue-27 figure (``figure_claims.png``): accuracy, budget and contamination over the steps."""
SMOOTHED_ADAPTIVE = frozenset({"KV budget sampled with", "contaminated sequences (any rho < 0.5)", "train reward"})
"""Per-step panels of the issue-27 figure drawn as trailing means (``SMOOTH_STEPS``)."""
CLAIM_PANELS_LAGCHAIN = {
    "shortcut-free accuracy, dense inference": MN.EVAL_DENSE_SHORTCUT_FREE_ACCURACY,
    "shortcut-free accuracy, sparse inference": MN.EVAL_SPARSE_SHORTCUT_FREE_ACCURACY,
    "KV budget sampled with": MN.ROLLOUT_BUDGET_SAMPLED_MEAN,
    "tokens with rho < 0.5": MN.SPARSE_TOKEN_BELOW_FRAC,
    "contaminated sequences (any rho < 0.5)": MN.SPARSE_CONTAMINATED_FRAC,
    "KV tokens held per sequence (peak)": MN.ROLLOUT_KV_TOKENS_PEAK_MEAN,
    "train reward": MN.ROLLOUT_REWARD_MEAN,
    "largest grad norm of the step's optimizer steps": MN.TRAIN_GRAD_NORM_MAX,
}
"""Panels of the issue-39 figure: issue 27's, the adaptive arm's signal (the token share) and the grad norm (linear:
the text compares runs' largest norms, ``results.run_maxima``, drawn per seed in ``figure_tests.png``)."""
SMOOTHED_LAGCHAIN = SMOOTHED_ADAPTIVE | {"tokens with rho < 0.5"}


SMOOTH_STEPS = 10
"""Trailing window of the per-step panels drawn smoothed (``smooth``): a step's 64 sequences give a share a
sampling sd of ~0.05, larger than the trends these panels are read for."""


def _trailing_mean(series: dict[int, float], window: int) -> dict[int, float]:
    """Each step's value -> the mean of that step's and up to ``window - 1`` earlier logged steps' values."""
    steps = sorted(series)
    return {s: sum(series[t] for t in steps[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
            for i, s in enumerate(steps)}


def _curve(by_seed: dict[int, list[dict]], key: str, window: int = 1
           ) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min, max over seeds of ``key`` (steps where every seed has it; each seed's series first
    averaged over a trailing ``window`` of steps)."""
    per_seed = [{r["step"]: r[key] for r in recs if r.get(key) is not None} for recs in by_seed.values()]
    if window > 1:
        per_seed = [_trailing_mean(p, window) for p in per_seed]
    steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
    mean = [sum(p[s] for p in per_seed) / len(per_seed) for s in steps]
    return steps, mean, [min(p[s] for p in per_seed) for s in steps], [max(p[s] for p in per_seed) for s in steps]


def draw_figure(records: dict[str, dict[int, list[dict]]], out: str | Path, what: str = "arms",
                panels: dict[str, str] | None = None,
                marks: dict[str, tuple[float, str]] | None = None,
                smooth: frozenset[str] = frozenset(), labels: Mapping[str, str] | None = None,
                offscale: Mapping[str, tuple[str, ...]] | None = None) -> Path | None:
    """Draw ``records`` (``{arm: {seed: metrics records}}``) to ``out`` (``panels``: title -> metric, default
    ``PANELS``; ``marks``: title -> (value, label), a dashed horizontal line in that panel, e.g. a controller's
    target; ``smooth``: titles drawn as trailing ``SMOOTH_STEPS``-step means; ``labels``: arm -> legend text, e.g.
    ``arm_labels``; ``offscale``: title -> arms left out of that panel's axis, which is scaled to the other arms,
    and written in it as a note of their mean, ``off_scale_note``); None when there is nothing to draw."""
    if not records:
        return None
    panels = panels or PANELS
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cols = 4
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.3 * rows), squeeze=False)
    colours = {name: f"C{i % 10}" for i, name in enumerate(records)}
    labels = {name: (labels or {}).get(name, name) for name in records}
    for ax, (title, key) in zip(axes.flat, panels.items()):
        notes = []
        for name, by_seed in records.items():
            steps, mean, low, high = _curve(by_seed, key, SMOOTH_STEPS if title in smooth else 1)
            if not steps:
                continue
            if name in (offscale or {}).get(title, ()):
                notes.append(off_scale_note(labels[name], mean))
                continue
            single = len(steps) == 1
            ax.plot(steps, mean, color=colours[name], label=labels[name], marker="*" if single else "o",
                    markersize=11 if single else 3, linestyle="none" if single else "-")
            if len(by_seed) > 1 and not single:
                ax.fill_between(steps, low, high, color=colours[name], alpha=0.15)
        if notes:
            ax.text(0.5, 0.97, "\n".join(notes), transform=ax.transAxes, ha="center", va="top", fontsize=8,
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "grey"})
            low, high = ax.get_ylim()
            ax.set_ylim(low, high + 0.35 * (high - low))  # room for the note above the curves
        if title in (marks or {}):
            value, label = marks[title]
            ax.axhline(value, color="black", linestyle="--", linewidth=1)
            ax.annotate(label, (0.01, value), xycoords=("axes fraction", "data"), xytext=(0, 3),
                        textcoords="offset points", fontsize=8)
        ax.set_title(f"{title} ({SMOOTH_STEPS}-step mean)" if title in smooth else title, fontsize=10)
        if title in LOG_PANELS and all(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")
        ax.set_xlabel("rollout step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    spare = list(axes.flat)[len(panels):]
    for ax in spare:
        ax.axis("off")
    legend = {}  # every arm's first line, whichever panel drew it (an off-scale arm is missing from some)
    for ax in axes.flat:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(text, handle)
    order = [labels[name] for name in records if labels[name] in legend]
    handles, texts = [legend[t] for t in order], order
    # the legend in a spare panel, else in a row under the grid: never over a panel's data
    if spare:
        spare[0].legend(handles, texts, loc="center", fontsize=9, ncol=1)
    else:
        fig.legend(handles, texts, loc="lower center", fontsize=9, ncol=len(texts))
    seeds = sorted({s for by_seed in records.values() for s in by_seed})
    fig.suptitle(f"Sparse-RL claims at CPU scale, {what} (seeds {', '.join(map(str, seeds))}; lines: mean over seeds, "
                 "band: min-max)")
    fig.tight_layout(rect=(0, 0 if spare else 0.05, 1, 1))
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


TESTS_FIGURE_FILE = "figure_tests.png"
"""The registered tests as the analysis decided them (``draw_tests_figure``), beside ``figure_claims.png``."""
BUDGET_METRIC = MN.ROLLOUT_BUDGET_SAMPLED_MEAN
"""The mean budget in a step's samples' provenance (``analysis.BUDGET_KEY``): the budgets the legend names."""


def arm_labels(records: Mapping[str, Mapping[int, list[dict]]]) -> dict[str, str]:
    """Each arm's legend text: its name and the KV budgets its rollouts logged (``BUDGET_METRIC`` over every step
    and seed): ``B = 14`` when one, ``adaptive B = 16-21`` (the range) when it moved, ``dense KV`` when none."""
    out = {}
    for name, by_seed in records.items():
        budgets = [r[BUDGET_METRIC] for recs in by_seed.values() for r in recs if r.get(BUDGET_METRIC) is not None]
        if not budgets:
            out[name] = f"{name} (dense KV)"
            continue
        low, high = round(min(budgets), 1), round(max(budgets), 1)
        out[name] = f"{name} (B = {low:g})" if low == high else f"{name} (adaptive B = {low:g}-{high:g})"
    return out


def off_scale_note(label: str, curve: Sequence[float]) -> str:
    """The note an off-scale arm gets in its panel: its curve's mean over the steps."""
    return f"{label}: {sum(curve) / len(curve):.1f} on average (off this axis)"


def _test_title(name: str, r: Mapping) -> str:
    verdict = r["verdict"]
    if r.get("p_holm") is not None:
        verdict += f", Holm p {r['p_holm']:.2g}"
    elif r.get("p_sign_flip") is not None:
        verdict += f", sign-flip p {r['p_sign_flip']:.2g}"
    if verdict.startswith("against") and r.get("p_against") is not None:
        verdict += f" (opposite p {r['p_against']:.2g})"
    fp = r.get("footprint")
    if fp:
        verdict += (f"; footprint {fp['arm_kv_tokens']:.1f} vs {fp['reference_kv_tokens']:.1f} KV tokens "
                    f"({fp['reference_arm']})")
    return "\n".join(textwrap.wrap(f"{name}: {r['test']['claim']}", 52) + textwrap.wrap(verdict, 52))


def _draw_test(ax, name: str, r: Mapping) -> None:
    """One test's panel: the per-seed d_s as dots at their seeds, the mean with its 95% t interval right of them,
    the margin as a dashed line; the title names the claim and the verdict."""
    ax.set_title(_test_title(name, r), fontsize=8)
    if "diffs" not in r:  # not run: nothing to draw
        ax.text(0.5, 0.5, "no differences", transform=ax.transAxes, ha="center", va="center")
        ax.set_xticks([])
        return
    seeds, diffs = list(r["seeds"]), list(r["diffs"])
    ax.plot(seeds, diffs, marker="o", linestyle="none", color="C0", label="d_s, per seed")
    x = max(seeds) + 1.5
    mean, low, high = r["mean"], r["ci_low"], r["ci_high"]
    if math.isfinite(low) and math.isfinite(high):
        ax.errorbar([x], [mean], yerr=[[mean - low], [high - mean]], fmt="D", color="black", capsize=4,
                    label="mean, 95% t CI")
    else:
        ax.plot([x], [mean], marker="D", linestyle="none", color="black", label="mean, 95% t CI")
    ax.axhline(r["margin"], color="C3", linestyle="--", linewidth=1, label="the test's margin (H1: mean > it)")
    ax.set_xticks([*seeds, x], [*map(str, seeds), "mean"], fontsize=8)
    ax.set_xlabel("seed", fontsize=8)
    ax.set_ylabel("d_s (points)", fontsize=8)
    ax.grid(alpha=0.3)


def _draw_run_maxima(ax, run_max: Mapping[str, Mapping[int, float]], title: str,
                     labels: Mapping[str, str]) -> None:
    """Per arm each seed's run maximum as a dot and their median as a bar, on a linear axis."""
    names = list(run_max)
    for i, name in enumerate(names):
        values = list(run_max[name].values())
        ax.plot([i] * len(values), values, marker="o", linestyle="none", color=f"C{i % 10}", alpha=0.7)
        median = statistics.median(values)
        ax.plot([i - 0.3, i + 0.3], [median, median], color="black", linewidth=2)
        ax.annotate(f"{median:.2g}", (i + 0.32, median), fontsize=7, va="center")
    ax.set_xticks(range(len(names)), [labels.get(n, n) for n in names], fontsize=7, rotation=25, ha="right")
    ax.set_yscale("linear")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)


def draw_tests_figure(tests: Mapping[str, Mapping], out: str | Path,
                      run_max: Mapping[str, Mapping[int, float]] | None = None,
                      labels: Mapping[str, str] | None = None, what: str = "") -> Path | None:
    """Draw the registered tests as the analysis decided them (``tests``: ``analysis.json``'s ``tests``, name ->
    ``analysis.decide``'s result) to ``out``: one panel per test, the per-seed paired endpoint differences d_s
    (its ``seeds`` and ``diffs``), their mean and two-sided 95% t interval (``mean``, ``ci_low``, ``ci_high``), the
    margin, the verdict in the title. ``run_max``: arm -> seed -> a run's largest gradient norm
    (``results.run_maxima``), one more panel, linear, medians marked. None when there is nothing to draw."""
    if not tests:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(tests) + (1 if run_max else 0)
    cols = 4
    rows = (count + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    for ax, (name, r) in zip(axes.flat, tests.items()):
        _draw_test(ax, name, r)
    if run_max:
        _draw_run_maxima(axes.flat[len(tests)], run_max, "largest grad norm of a run (dots: seeds; bar: median)",
                         labels or {})
    spare = list(axes.flat)[count:]
    for ax in spare:
        ax.axis("off")
    drawn = [ax for ax, r in zip(axes.flat, tests.values()) if "diffs" in r]
    if drawn:
        handles, texts = drawn[0].get_legend_handles_labels()
        if spare:
            spare[0].legend(handles, texts, loc="center", fontsize=9)
        else:
            fig.legend(handles, texts, loc="lower center", fontsize=9, ncol=len(texts))
    fig.suptitle("The pre-registered tests: per-seed paired endpoint differences d_s (points), mean and 95% t CI, "
                 f"margin{f'; {what}' if what else ''}")
    fig.tight_layout(rect=(0, 0 if spare else 0.05, 1, 1))
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> Path | None:
    """``python -m sparse_rl_megatron.experiment.figure ANALYSIS_JSON OUT_PNG``: the tests figure of a saved
    analysis (``analysis.json``, or a file with its ``tests`` and optionally ``run_max`` and ``what``), without the
    run directories (``--stage report`` draws it with the rest)."""
    parser = argparse.ArgumentParser(prog="python -m sparse_rl_megatron.experiment.figure",
                                     description=main.__doc__)
    parser.add_argument("analysis", help="analysis.json (its 'tests')")
    parser.add_argument("out", help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        saved = json.loads(Path(args.analysis).read_text())
    except (OSError, ValueError) as err:
        parser.error(f"analysis: cannot read {args.analysis} as JSON ({type(err).__name__}: {err})")
    if not isinstance(saved, dict) or not isinstance(saved.get("tests"), dict):
        parser.error(f"analysis: {args.analysis} has no 'tests' object (an analysis.json of --stage report)")
    run_max = {arm: {int(s): v for s, v in by_seed.items()} for arm, by_seed in saved.get("run_max", {}).items()}
    return draw_tests_figure(saved["tests"], args.out, run_max or None, what=saved.get("what", ""))


if __name__ == "__main__":
    main()
