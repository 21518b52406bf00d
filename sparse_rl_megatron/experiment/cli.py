"""``sparse-rl experiment --config RECIPE.yaml [--stage S] [--seeds ...] [--arms ...] [--budgets ...] [--out DIR]
[key=value]``: the paper's claims as arms of ``sparse-rl train`` runs on shared warm starts, with results tables,
paired statistics and figures.

A re-run skips complete work and resumes a stopped arm. ``--stage`` (``runner.STAGES``): ``warm``, ``budgets``
(the budget rule), ``arms`` (default), ``study`` (compounding test, other caches), ``report`` (= ``--report``).
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiment recipe (e.g. configs/experiments/cpu_claims.yaml)")
    parser.add_argument("--seeds", nargs="+", help="seeds (default: the recipe's experiment.seeds)")
    parser.add_argument("--arms", nargs="+", help="arms in order: dense naive sparse_rl sparse_rl_snapkv sft")
    parser.add_argument("--budgets", nargs="+", help="budget sweep of the naive and sparse_rl arms")
    parser.add_argument("--out", help="experiment directory (default: the recipe's experiment.out)")
    parser.add_argument("--stage", default="arms", help="warm | budgets | arms (default) | study | report "
                                                         "(sparse_rl_megatron/experiment/runner.py STAGES)")
    parser.add_argument("--report", action="store_true", help="only rewrite results and figure (= --stage report)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.steps=5 (they may also "
                                                     "follow a list option: an item with '=' is an override)")


def split_lists(args: argparse.Namespace) -> tuple[dict[str, list], list[str]]:
    """The list options' values and the ``key=value`` overrides that argparse gave to them (a list option takes
    every item after it); integers checked for ``--seeds`` and ``--budgets``."""
    from sparse_rl_megatron.utils.errors import UsageError

    lists, overrides = {}, list(args.overrides)
    for name in ("seeds", "arms", "budgets"):
        items = getattr(args, name)
        if items is None:
            continue
        overrides += [i for i in items if "=" in i]
        values = [i for i in items if "=" not in i]
        if name != "arms":
            bad = [v for v in values if not v.lstrip("-").isdigit()]
            if bad:
                raise UsageError(f"--{name} takes integers, got {' '.join(bad)}")
            values = [int(v) for v in values]
        lists[name] = values
    return lists, overrides


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.experiment.config import ExperimentConfig
    from sparse_rl_megatron.utils.config_io import load_config

    lists, overrides = split_lists(args)
    overrides += [f"experiment.{k}={v}" for k, v in lists.items()]
    if args.out is not None:
        overrides.append(f"experiment.out={args.out!r}")
    cfg = load_config(ExperimentConfig, args.config, overrides)
    from sparse_rl_megatron.experiment.runner import run_experiment

    run_experiment(cfg, stage="report" if args.report else args.stage)
    return 0
