"""PNG figures of a run's metrics: one panel per metric group, step on the x axis."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from sparse_rl_megatron.observability.metrics_writer import read_metrics

# Panels a person wants to see first for a Sparse-RL run: reward, the sparsity mismatch tail, the
# correction's effect, and optimisation health. A key missing from the run is left out of the figure.
DEFAULT_PANELS: dict[str, Sequence[str]] = {
    "reward": ("rollout/reward_mean", "eval/accuracy"),
    "rho tail": ("sparse/rho_p1", "sparse/rho_p5", "sparse/rho_min"),
    "rejection": ("sparse/rejected_seq_frac", "sparse/rejected_token_frac", "sparse/truncated_frac"),
    "mismatch KL": ("sparse/kl_k1", "sparse/kl_k3", "sparse/kl_old_sparse_k3"),
    "optimisation": ("loss/pg", "loss/clip_frac", "train/grad_norm"),
    "response length": ("rollout/response_len_mean",),
}
LOG_SCALE_PANELS = frozenset({"rho tail"})
"""Panels drawn on a log y axis: the rho tail spans orders of magnitude (1e-4 veto threshold to ~1)."""


def plot_metrics(metrics_path: str | Path, out_path: str | Path,
                 panels: dict[str, Sequence[str]] | None = None) -> Path | None:
    """Draw the panels whose keys appear in ``metrics_path``; returns the PNG path (None if nothing to draw)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
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
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=key.split("/", 1)[-1])
        ax.set_title(title)
        if title in LOG_SCALE_PANELS and all(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
