"""``sparse-rl experiment --config RECIPE.yaml [--seeds ...] [--arms ...] [--budgets ...] [--out DIR] [key=value]``:
the paper's claims as arms of ``sparse-rl train`` runs on shared warm starts, with a results table and a figure.

A re-run skips complete arms and resumes a stopped one. ``--report`` only rewrites the table and the figure
from what is complete.
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiment recipe (e.g. configs/experiments/cpu_claims.yaml)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds (default: the recipe's experiment.seeds)")
    parser.add_argument("--arms", nargs="+", help="arms in order: dense naive sparse_rl sparse_rl_snapkv sft")
    parser.add_argument("--budgets", type=int, nargs="+", help="budget sweep of the naive and sparse_rl arms")
    parser.add_argument("--out", help="experiment directory (default: the recipe's experiment.out)")
    parser.add_argument("--report", action="store_true", help="only rewrite results and figure from complete arms")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.steps=5")


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.experiment.config import ExperimentConfig
    from sparse_rl_megatron.utils.config_io import load_config

    flags = {"seeds": args.seeds, "arms": args.arms, "budgets": args.budgets, "out": args.out}
    overrides = [f"experiment.{k}={v!r}" if k == "out" else f"experiment.{k}={list(v)}"
                 for k, v in flags.items() if v is not None]
    cfg = load_config(ExperimentConfig, args.config, [*args.overrides, *overrides])
    if args.report:
        from sparse_rl_megatron.experiment.results import write_report

        table, figure = write_report(cfg)
        print(f"results: {table}  figure: {figure}")
        return 0
    from sparse_rl_megatron.experiment.runner import run_experiment

    run_experiment(cfg)
    return 0
