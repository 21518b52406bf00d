"""``sparse-rl plot RUN_DIR``: draw a run's curves (reward, held-out accuracy dense and sparse, rejection rate,
clip ratio, rho p1/p5, grad norm, KV memory, ...) from its ``metrics.jsonl`` into a PNG.

Works on a finished run and on one still training (it reads what has been written so far).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from sparse_rl_megatron.observability.metrics_writer import METRICS_FILE
from sparse_rl_megatron.observability.plots import PLOT_FILE
from sparse_rl_megatron.utils.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help=f"a run directory (holding {METRICS_FILE})")
    parser.add_argument("--output", default=None, help=f"PNG path (default RUN_DIR/{PLOT_FILE})")


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.observability.plots import plot_metrics

    run_dir = Path(args.run_dir)
    metrics = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    if not metrics.is_file():
        raise UserError(f"{run_dir} has no {METRICS_FILE}: not a run directory, or the run logged no step yet")
    out = plot_metrics(metrics, args.output or run_dir / PLOT_FILE)
    if out is None:
        raise UserError(f"{metrics} holds no metric that any panel draws")
    print(f"wrote {out}")
    return 0
