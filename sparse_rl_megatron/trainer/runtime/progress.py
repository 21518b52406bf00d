"""What a run shows while it trains: a heartbeat per phase, a table of key metrics per step.

Heartbeat: each rank records its current step and phase in ``run_dir/heartbeat/rank<r>`` (overwritten, one
line) as each phase starts; with ``log.heartbeat`` rank 0 also prints it. A hung multi-node run says where it
hangs: the ranks whose file names another phase, or an old time, are the ones to look at.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

HEARTBEAT_DIR = "heartbeat"

SHOWN = ("rollout/reward_mean", "rollout/response_len_mean", "rollout/kv_tokens_peak_mean",
         "rollout/kv_tokens_dense_mean", "rollout/budget", "rollout/budget_signal", "sparse/rho_p1", "sparse/rho_min", "sparse/rejected_seq_frac",
         "sparse/rejected_token_frac", "loss/pg", "loss/clip_frac", "train/grad_norm", "sync/probe_mean_abs_diff",
         "eval/dense/accuracy", "eval/sparse/accuracy", "eval/dense/shortcut_free_accuracy",
         "eval/sparse/shortcut_free_accuracy", "time/rollout_s", "time/train_s", "time/sync_s")
"""Metrics of the per-step table (a key missing from a step is left out)."""


class Heartbeat:
    """``phase(step, name)`` as each phase starts; ``where`` is the last one (for error messages)."""

    def __init__(self, run_dir: str | Path, rank: int, echo: bool):
        self.dir = Path(run_dir) / HEARTBEAT_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank{rank}"
        self.rank = rank
        self.echo = echo and rank == 0
        self.where = "set-up"

    def phase(self, step: int, name: str) -> None:
        self.where = f"{name} of step {step}"
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {self.rank} step {step} {name}"
        self.path.write_text(line + "\n")
        if self.echo:
            print(f"[heartbeat] {line}", file=sys.stderr, flush=True)


def print_step(console, step: int, total: int, metrics: dict[str, float]) -> None:
    """A compact table of the ``SHOWN`` metrics of one step."""
    from rich.table import Table

    table = Table(title=f"step {step}/{total}", show_header=False, box=None, title_justify="left")
    for key in SHOWN:
        if metrics.get(key) is not None:
            table.add_row(key, f"{metrics[key]:.4g}")
    console.print(table)
