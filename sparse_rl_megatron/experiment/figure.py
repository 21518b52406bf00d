"""The experiment's figure: one panel per metric, one line per arm (mean over seeds, shaded min-max when
there are several), rollout step on the x axis. The supervised control has no rollouts: it appears as a
marker at the last step of the accuracy panels."""
from __future__ import annotations

from pathlib import Path

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
    "grad norm (log scale)": MN.TRAIN_GRAD_NORM,
}
"""Panels of the issue-39 figure: issue 27's, the adaptive arm's signal (the token share) and the grad norm."""
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
                smooth: frozenset[str] = frozenset()) -> Path | None:
    """Draw ``records`` (``{arm: {seed: metrics records}}``) to ``out`` (``panels``: title -> metric, default
    ``PANELS``; ``marks``: title -> (value, label), a dashed horizontal line in that panel, e.g. a controller's
    target; ``smooth``: titles drawn as trailing ``SMOOTH_STEPS``-step means); None when there is nothing to
    draw."""
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
    for ax, (title, key) in zip(axes.flat, panels.items()):
        for name, by_seed in records.items():
            steps, mean, low, high = _curve(by_seed, key, SMOOTH_STEPS if title in smooth else 1)
            if not steps:
                continue
            single = len(steps) == 1
            ax.plot(steps, mean, color=colours[name], label=name, marker="*" if single else "o",
                    markersize=11 if single else 3, linestyle="none" if single else "-")
            if len(by_seed) > 1 and not single:
                ax.fill_between(steps, low, high, color=colours[name], alpha=0.15)
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
    handles, labels = axes.flat[1].get_legend_handles_labels()
    # the legend in a spare panel, else in a row under the grid: never over a panel's data
    if spare:
        spare[0].legend(handles, labels, loc="center", fontsize=9, ncol=1)
    else:
        fig.legend(handles, labels, loc="lower center", fontsize=9, ncol=len(labels))
    seeds = sorted({s for by_seed in records.values() for s in by_seed})
    fig.suptitle(f"Sparse-RL claims at CPU scale, {what} (seeds {', '.join(map(str, seeds))}; lines: mean over seeds, "
                 "band: min-max)")
    fig.tight_layout(rect=(0, 0 if spare else 0.05, 1, 1))
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
