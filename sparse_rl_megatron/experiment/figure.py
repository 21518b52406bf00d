"""The experiment's figure: one panel per metric, one line per arm (mean over seeds, shaded min-max when
there are several), rollout step on the x axis. The supervised control has no rollouts: it appears as a
marker at the last step of the accuracy panels."""
from __future__ import annotations

from pathlib import Path

FIGURE_FILE = "figure.png"
SWEEP_FIGURE_FILE = "figure_sweep.png"
PANELS = {
    "train reward": "rollout/reward_mean",
    "held-out accuracy, dense inference": "eval/dense/accuracy",
    "held-out accuracy, sparse inference": "eval/sparse/accuracy",
    "grad norm": "train/grad_norm",
    "rejected sequences": "sparse/rejected_seq_frac",
    "clip ratio": "loss/clip_frac",
    "rho p1": "sparse/rho_p1",
    "rho p5": "sparse/rho_p5",
    "repetition rate (repeated 4-grams)": "rollout/repetition_rate",
    "KV tokens held per sequence (peak)": "rollout/kv_tokens_peak_mean",
}
LOG_PANELS = frozenset({"rho p1", "rho p5", "grad norm (log scale)"})
CLAIMS_FIGURE_FILE = "figure_claims.png"
CLAIM_PANELS = {
    "held-out accuracy, dense inference": "eval/dense/accuracy",
    "held-out accuracy, sparse inference": "eval/sparse/accuracy",
    "class odd_x_stop, dense (learning)": "eval/dense/modchain_weak/subset_odd_x_stop/accuracy",
    "rest, dense (damage)": "eval/dense/modchain_weak/subset_rest/accuracy",
    "train reward": "rollout/reward_mean",
    "would-be veto (rho < 1e-4)": "sparse/would_veto_frac",
    "T=1 entropy of the sampler (nats/token)": "sparse/entropy_sampler",
    "grad norm (log scale)": "train/grad_norm",
}
"""Panels of the issue-20 figure (``figure_claims.png``)."""
CLAIM_PANELS_27 = {
    "shortcut-free accuracy, dense inference": "eval/dense/shortcut_free_accuracy",
    "shortcut-free accuracy, sparse inference": "eval/sparse/shortcut_free_accuracy",
    "KV budget sampled with (mean)": "rollout/budget_sampled_mean",
    "contaminated sequences (any rho < 0.5)": "sparse/contaminated_frac",
    "KV tokens held per sequence (peak)": "rollout/kv_tokens_peak_mean",
    "train reward": "rollout/reward_mean",
}
"""Panels of the issue-27 figure (``figure_claims.png``): accuracy, budget and contamination over the steps."""


def _curve(by_seed: dict[int, list[dict]], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min, max over seeds of ``key`` (steps where every seed has it)."""
    per_seed = [{r["step"]: r[key] for r in recs if r.get(key) is not None} for recs in by_seed.values()]
    steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
    mean = [sum(p[s] for p in per_seed) / len(per_seed) for s in steps]
    return steps, mean, [min(p[s] for p in per_seed) for s in steps], [max(p[s] for p in per_seed) for s in steps]


def draw_figure(records: dict[str, dict[int, list[dict]]], out: str | Path, what: str = "arms",
                panels: dict[str, str] | None = None) -> Path | None:
    """Draw ``records`` (``{arm: {seed: metrics records}}``) to ``out`` (``panels``: title -> metric, default
    ``PANELS``); None when there is nothing to draw."""
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
            steps, mean, low, high = _curve(by_seed, key)
            if not steps:
                continue
            single = len(steps) == 1
            ax.plot(steps, mean, color=colours[name], label=name, marker="*" if single else "o",
                    markersize=11 if single else 3, linestyle="none" if single else "-")
            if len(by_seed) > 1 and not single:
                ax.fill_between(steps, low, high, color=colours[name], alpha=0.15)
        ax.set_title(title, fontsize=10)
        if title in LOG_PANELS and all(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")
        ax.set_xlabel("rollout step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=9, ncol=1)
    seeds = sorted({s for by_seed in records.values() for s in by_seed})
    fig.suptitle(f"Sparse-RL claims at CPU scale, {what} (seeds {', '.join(map(str, seeds))}; lines: mean over seeds, "
                 "band: min-max)")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
