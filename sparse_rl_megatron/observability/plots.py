"""PNG figures of a run's metrics: one panel per metric group, the (integer) rollout step on the x axis.

Lines are labelled with their full metric key (``rollout/truncated_frac`` and ``sparse/truncated_frac`` are
different things). Metrics logged only at some steps (evaluation) are drawn at those steps.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.observability.metrics_writer import read_metrics

# Panels a person wants to see first for a Sparse-RL run: reward, the sparsity mismatch tail, the
# correction's effect, and optimisation health. A key missing from the run is left out of the figure.
DEFAULT_PANELS: dict[str, Sequence[str]] = {
    "train reward": (MN.ROLLOUT_REWARD_MEAN,),
    "held-out accuracy": (MN.EVAL_DENSE_ACCURACY, MN.EVAL_SPARSE_ACCURACY, MN.EVAL_ADAPTIVE_ACCURACY,
                          MN.EVAL_DENSE_SHORTCUT_FREE_ACCURACY, MN.EVAL_SPARSE_SHORTCUT_FREE_ACCURACY,
                          MN.EVAL_ADAPTIVE_SHORTCUT_FREE_ACCURACY, MN.EVAL_DENSE_FULL_CHAIN_FRAC,
                          MN.EVAL_SPARSE_FULL_CHAIN_FRAC),
    "rejection rate": (MN.SPARSE_REJECTED_SEQ_FRAC, MN.SPARSE_REJECTED_TOKEN_FRAC),
    "contamination (any rho < 0.5)": (MN.SPARSE_CONTAMINATED_FRAC, MN.SPARSE_WOULD_VETO_FRAC),
    "adaptive KV budget": (MN.ROLLOUT_BUDGET,),
    "adaptive budget signal vs target": (MN.ROLLOUT_BUDGET_SIGNAL, MN.ROLLOUT_BUDGET_TARGET),
    "clip ratio": (MN.LOSS_CLIP_FRAC,),
    "rho tail": (MN.SPARSE_RHO_P1, MN.SPARSE_RHO_P5, MN.SPARSE_RHO_MIN),
    "grad norm": (MN.TRAIN_GRAD_NORM,),
    "KV memory (tokens per sequence)": (MN.ROLLOUT_KV_TOKENS_PEAK_MEAN, MN.ROLLOUT_KV_TOKENS_DENSE_MEAN),
    "mismatch KL": (MN.SPARSE_KL_K1, MN.SPARSE_KL_K3, MN.SPARSE_KL_OLD_SPARSE_K3),
    "truncation": (MN.ROLLOUT_TRUNCATED_FRAC, MN.SPARSE_TRUNCATED_FRAC),
    "response length": (MN.ROLLOUT_RESPONSE_LEN_MEAN,),
    "policy loss": (MN.LOSS_PG,),
    "seconds per phase": (MN.TIME_ROLLOUT_S, MN.TIME_RECOMPUTE_S, MN.TIME_TRAIN_S, MN.TIME_SYNC_S, MN.TIME_EVAL_S),
}
PLOT_FILE = "metrics.png"
"""Where a run's figure goes in its run directory."""
LOG_SCALE_PANELS = frozenset({"rho tail"})
"""Panels drawn on a log y axis: the rho tail spans orders of magnitude (1e-4 veto threshold to ~1)."""


def plot_metrics(metrics_path: str | Path, out_path: str | Path,
                 panels: dict[str, Sequence[str]] | None = None) -> Path | None:
    """Draw the panels whose keys appear in ``metrics_path``; returns the PNG path (None if nothing to draw)."""
    fig = build_figure(read_metrics(metrics_path), panels)  # selects the Agg backend before pyplot is imported
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    out = Path(out_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def build_figure(records: list[dict], panels: dict[str, Sequence[str]] | None = None):
    """A matplotlib figure with one axis per panel that has data in ``records`` (None when none has)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = panels or DEFAULT_PANELS
    present = {
        title: [k for k in keys if any(r.get(k) is not None for r in records)] for title, keys in panels.items()
    }
    present = {title: keys for title, keys in present.items() if keys}
    if not present:
        return None
    cols = min(3, len(present))
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, present.items()):
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=key)
        ax.set_title(title)
        if title in LOG_SCALE_PANELS and all(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole rollout steps
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    return fig
