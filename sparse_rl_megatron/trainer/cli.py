"""``sparse-rl train [--config RECIPE.yaml] [key.path=value ...]``: train (or resume) a Sparse-RL run.

Without ``--config`` it runs the embedded CPU default (``configs/cpu_default.yaml``). Under ``torchrun`` every
rank runs this same command (``launch/torchrun.sh``). Overrides are YAML scalars at dotted paths, e.g.
``steps=10 rollout.compression.budget=64 learner.tensor_parallel_size=2``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "cpu_default.yaml"
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None,
                        help=f"YAML recipe (default: the embedded CPU default, {DEFAULT_RECIPE.name})")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (recipe + includes + overrides) as YAML and exit")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. steps=5 rollout.compression.budget=64")


def load(args: argparse.Namespace):
    """The ``TrainConfig`` of the command line, with its ``plugins`` imported."""
    import importlib

    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.utils.config_io import load_config
    from sparse_rl_megatron.utils.errors import UserError

    cfg = load_config(TrainConfig, args.config or DEFAULT_RECIPE, args.overrides)
    if cfg.expect is not None:  # the verdict at the end names what the command line changed
        from sparse_rl_megatron.trainer.runtime.expected_result import overridden_keys

        cfg.expect.overridden = overridden_keys(args.overrides)
    for i, module in enumerate(cfg.plugins):
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise UserError(f"plugins[{i}]: cannot import '{module}' ({err}); is it on PYTHONPATH?") from None
    return cfg


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.trainer.runtime import distributed as D
    from sparse_rl_megatron.utils.errors import RunFailed, UserError

    cfg = load(args)
    if args.print_config:
        import yaml

        from sparse_rl_megatron.utils.config_io import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    from sparse_rl_megatron.trainer.loop import train
    from sparse_rl_megatron.trainer.runtime.signals import early_stops_noted

    try:
        with early_stops_noted():
            train(cfg)
    except UserError as err:
        # a mistake in the command is every rank's: this node's first rank prints it; a failure (RunFailed) is
        # printed by the rank it happened on; one relayed from rank 0 is printed there
        if getattr(err, "relayed_from_main", False) or (D.env_local_rank() != 0 and not isinstance(err, RunFailed)):
            return err.exit_code
        raise
    except KeyboardInterrupt:
        from sparse_rl_megatron.trainer.checkpointing.checkpoints import latest_checkpoint

        latest = latest_checkpoint(cfg.run_dir)
        print(f"sparse-rl train: aborted by a second Ctrl-C; "
              f"{f'last complete checkpoint {latest}' if latest else 'no checkpoint was saved'} "
              "(rerun the same command to resume)", file=sys.stderr)
        return 130
    return 0
