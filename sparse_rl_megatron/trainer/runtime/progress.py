"""What a run shows while it trains: a heartbeat per phase, a table of key metrics per step.

Heartbeat: each rank records its current step and phase in ``run_dir/heartbeat/rank<r>`` (overwritten, one
line) as each phase starts; with ``log.heartbeat`` rank 0 also prints it. A hung multi-node run says where it
hangs: the ranks whose file names another phase, or an old time, are the ones to look at.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from sparse_rl_megatron.observability import metric_names as MN

HEARTBEAT_DIR = "heartbeat"

SHOWN = (MN.ROLLOUT_REWARD_MEAN, MN.ROLLOUT_RESPONSE_LEN_MEAN, MN.ROLLOUT_KV_TOKENS_PEAK_MEAN,
         MN.ROLLOUT_KV_TOKENS_DENSE_MEAN, MN.ROLLOUT_BUDGET, MN.ROLLOUT_BUDGET_SIGNAL, MN.SPARSE_RHO_P1,
         MN.SPARSE_RHO_MIN, MN.SPARSE_REJECTED_SEQ_FRAC, MN.SPARSE_REJECTED_TOKEN_FRAC, MN.LOSS_PG, MN.LOSS_CLIP_FRAC,
         MN.TRAIN_GRAD_NORM, MN.SYNC_PROBE_MEAN_ABS_DIFF,
         MN.EVAL_DENSE_ACCURACY, MN.EVAL_SPARSE_ACCURACY, MN.EVAL_DENSE_SHORTCUT_FREE_ACCURACY,
         MN.EVAL_SPARSE_SHORTCUT_FREE_ACCURACY, MN.TIME_ROLLOUT_S, MN.TIME_TRAIN_S, MN.TIME_SYNC_S)
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
