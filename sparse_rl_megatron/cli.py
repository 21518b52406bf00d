"""The ``sparse-rl`` command. Each subcommand lives in its own module, imported only when it runs.

A subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from sparse_rl_megatron.utils.errors import StoppedEarly, UsageError, UserError

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "audit": ("sparse_rl_megatron.tasks.audit_cli", "shortcut audit of built-in tasks: trivial policies' accuracy "
                                                   "vs chance, PASS / FAIL"),
    "convert": ("sparse_rl_megatron.convert_cli", "convert checkpoints HF <-> Megatron (torch_dist)"),
    "eval": ("sparse_rl_megatron.eval.cli", "evaluate a model on math benchmarks, dense or compressed-KV"),
    "experiment": ("sparse_rl_megatron.experiment.cli", "the paper's claims as arms of training runs (dense, naive sparse, "
                                                        "Sparse-RL, supervised control) with a table and a figure"),
    "gradients": ("sparse_rl_megatron.mismatch.gradient_cli",
                  "the gradient of each correction on compressed rollouts vs the dense on-policy gradient, per budget"),
    "mismatch": ("sparse_rl_megatron.mismatch.cli", "rho = pi_old / pi_sparse per KV budget vs dense: choose a budget "
                                                    "before training"),
    "plot": ("sparse_rl_megatron.observability.plot_cli", "draw a run's metric curves (PNG) from its metrics.jsonl"),
    "plan": ("sparse_rl_megatron.planning.cli", "per-GPU memory of a learner layout and the rollout KV budget"),
    "preflight": ("sparse_rl_megatron.trainer.launch_preflight",
                  "check a training launch on this node before torchrun"),
    "train": ("sparse_rl_megatron.trainer.cli", "train (or resume) Sparse-RL GRPO; no arguments: the CPU default"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-rl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command '{argv[0]}'; valid commands: {', '.join(SUBCOMMANDS)}")
        parser.print_help()
        return 0 if argv else 2
    from sparse_rl_megatron.utils.lifeline import end_with_parent, under_torchrun, unignore_stop_signals

    if under_torchrun():  # (utils/lifeline.py)
        end_with_parent()  # torchrun starts its ranks in sessions of their own: none may outlive it
        unignore_stop_signals()
    name, rest = argv[0], argv[1:]
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"sparse-rl {name}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    # What a command is loading (our INFO lines) and every warning go to stderr with the time: a first start
    # can take a while. Libraries' own INFO chatter stays off.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s: %(message)s", datefmt="%H:%M:%S")
    # Under torchrun, rank 0 speaks for all.
    logging.getLogger("sparse_rl_megatron").setLevel(
        logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    try:
        return int(module.run(args) or 0)
    except StoppedEarly as err:  # a stop the user asked for: one line, no traceback, not an error
        print(f"sparse-rl {name}: {err}", flush=True)
        return err.exit_code
    except UserError as err:  # a user's mistake: one line, no traceback
        if isinstance(err, UsageError):
            parser.print_usage(sys.stderr)
        print(f"sparse-rl {name}: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
