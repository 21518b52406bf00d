"""``sparse-rl mismatch``: the rho distribution per KV budget, side by side with dense, before training.

    sparse-rl mismatch [--config RECIPE.yaml] [key.path=value ...] [--budgets 64,128,256] [--compression rkv]
                       [--model DIR] [--dataset NAME] [--prompts N] [--samples N] [--max-new-tokens N] [--seed S]
                       [--output FILE.json] [--overwrite] [--plot]

The study is configured exactly like a training run: a train recipe (default: the embedded CPU default) plus
``key.path=value`` overrides, so it measures with the run's model, data, template, sampling, learner layout and
correction. The flags are shorthands for the fields a study changes most (``--compression`` is
``rollout.compression.method``, ``--prompts`` is ``rollout.prompts_per_step``, ...; see ``FLAG_FIELDS``); they are
applied after the overrides. ``--budgets`` lists the budgets compared (default: the recipe's budget). Under
``torchrun`` every rank runs this same command and rank 0 drives the engine, as in training.
"""
from __future__ import annotations

import argparse
from pathlib import Path

FLAG_FIELDS: dict[str, str] = {
    "model": "model_path",
    "dataset": "data.dataset",
    "template": "data.template",
    "compression": "rollout.compression.method",
    "prompts": "rollout.prompts_per_step",
    "samples": "rollout.samples_per_prompt",
    "max_new_tokens": "rollout.sampling.max_new_tokens",
    "seed": "seed",
}
"""Flag (argparse dest) -> the train-config field it sets."""
STUDY_OVERRIDES = ("global_batch_size=null", "eval.datasets=[]")
"""Applied last: a study takes no optimizer step and evaluates nothing, so the recipe's optimizer slicing and its
held-out sets neither apply nor may fail it."""
RESULTS_DIR = "mismatch"
"""Default folder of results, inside the run directory."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sparse_rl_megatron.trainer.cli import DEFAULT_RECIPE

    parser.add_argument("--config", default=None,
                        help=f"train recipe YAML (default: the embedded CPU default, {DEFAULT_RECIPE.name})")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of the recipe, e.g. "
                                                     "rollout.compression.window=8")
    g = parser.add_argument_group("what to compare")
    g.add_argument("--budgets", default=None, help="comma-separated KV budgets, e.g. 64,128,256 (default: the "
                                                   "recipe's rollout.compression.budget)")
    from sparse_rl_megatron.compression.scorers import methods_help

    g.add_argument("--compression", help="KV compressor (rollout.compression.method): " + methods_help(dense=False))
    g.add_argument("--model", help="model (model_path): HF directory, Megatron checkpoint, tiny or task:<name>")
    g.add_argument("--dataset", help="prompts (data.dataset): a named set, a JSONL/Parquet file or task:<name>")
    g.add_argument("--template", help="prompt template (data.template)")
    g.add_argument("--prompts", type=int, help="prompts, the run's first ones (rollout.prompts_per_step)")
    g.add_argument("--samples", type=int, help="samples per prompt, the GRPO group size (rollout.samples_per_prompt); "
                                               "not --n, which torchrun would take for its own --nnodes")
    g.add_argument("--max-new-tokens", type=int, help="response length (rollout.sampling.max_new_tokens)")
    g.add_argument("--seed", type=int, help="seed of the prompt order and the sampler (seed)")
    g = parser.add_argument_group("output")
    g.add_argument("--output", default=None, help=f"results JSON, written as given (default: <run_dir>/{RESULTS_DIR}/"
                                                  "<method>-B<budgets>.json, numbered -2, -3, ... when taken)")
    g.add_argument("--overwrite", action="store_true", help="let the default name replace an earlier study's results (JSON and PNG)")
    g.add_argument("--plot", action="store_true", help="also draw the log-rho histograms next to the JSON (.png)")
    # key=value overrides may come before, between or after the flags (plain parse_args takes them in one run)
    parser.parse_args = parser.parse_intermixed_args


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The ``key.path=value`` overrides the shorthand flags stand for."""
    return [f"{field}={getattr(args, dest)}" for dest, field in FLAG_FIELDS.items() if getattr(args, dest) is not None]


def parse_budgets(text: str | None, default: int) -> list[int]:
    """``--budgets`` as a list of distinct positive ints (``[default]`` when not given)."""
    from sparse_rl_megatron.utils.errors import UserError

    if text is None:
        return [default]
    budgets: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise UserError(f"--budgets: '{part}' is not a positive whole number; give budgets like 64,128,256")
        if int(part) in budgets:
            raise UserError(f"--budgets: {int(part)} is given twice")
        budgets.append(int(part))
    return budgets


def output_paths(args: argparse.Namespace, cfg, budgets: list[int]) -> tuple[Path, Path | None]:
    """The results JSON and PNG (None without ``--plot``), by the rule ``eval`` follows too: an explicit ``--output``
    is written as given; the default name never replaces an earlier study's files (numbered -2, -3, ... when taken)
    unless ``--overwrite``."""
    from sparse_rl_megatron.utils.errors import UserError
    from sparse_rl_megatron.utils.file_checks import first_free_path

    if args.output:
        json_path = Path(args.output)
        if json_path.is_dir():
            raise UserError(f"--output: {json_path} is a directory; give the results file's path")
    else:
        name = f"{cfg.rollout.compression.method}-B{'-'.join(map(str, budgets))}.json"
        json_path = Path(cfg.run_dir) / RESULTS_DIR / name
        if not args.overwrite:
            json_path = first_free_path(json_path, (".png",) if args.plot else ())
    return json_path, json_path.with_suffix(".png") if args.plot else None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from sparse_rl_megatron.compression.scorers import SCORERS
    from sparse_rl_megatron.mismatch.measure import measure
    from sparse_rl_megatron.mismatch.study import rejecting_correction, study_rows
    from sparse_rl_megatron.trainer.runtime import distributed as D
    from sparse_rl_megatron.trainer.cli import load
    from sparse_rl_megatron.trainer.run_plan import preflight
    from sparse_rl_megatron.utils.errors import UserError

    overrides = [*args.overrides, *flag_overrides(args), *STUDY_OVERRIDES]
    cfg = load(argparse.Namespace(config=args.config, overrides=overrides))
    compression = cfg.rollout.compression
    if compression.is_dense:
        methods = ", ".join(m for m in SCORERS.names() if m != compression.method)
        raise UserError(f"rollout.compression.method is '{compression.method}' (dense): name the compressor to study "
                        f"with --compression (valid: {methods})")
    budgets = parse_budgets(args.budgets, compression.budget)
    try:
        rows = study_rows(compression, budgets)
    except ValueError as err:
        raise UserError(f"--budgets: {err}") from None
    json_path, png_path = output_paths(args, cfg, budgets)
    # every bad option or file is one line before any model loads; the study rolls out, it does not evaluate
    plan = preflight(cfg, D.env_world_size(), lengths=("rollout",), training=False)  # bf16 learner on CPU: log-probs
    correction, note = rejecting_correction(cfg.correction)
    console = Console(soft_wrap=True)
    main = D.env_rank() == 0

    def say(text: str) -> None:
        if main:
            console.print(text)

    if note:
        say(f"[yellow]note[/]: {note}")
    try:
        measurement = measure(cfg, plan, rows, correction, say)
    except UserError as err:
        if getattr(err, "relayed_from_main", False) or D.env_local_rank() != 0:
            return err.exit_code  # rank 0 (or this node's first rank) prints the line
        raise
    if main:
        _report(cfg, plan, measurement, correction, [note] if note else [], json_path, png_path, console)
    return 0


def _report(cfg, plan, measurement, correction, notes, json_path: Path, png_path: Path | None, console) -> None:
    """Rank 0: write the results (and the PNG), print the table and the dense check."""
    from sparse_rl_megatron.eval.results import write_results
    from sparse_rl_megatron.mismatch.measure import STUDY_STEP
    from sparse_rl_megatron.mismatch.report import build_table, dense_check, plot_histograms, results_document
    from sparse_rl_megatron.trainer.runtime import distributed as D
    from sparse_rl_megatron.trainer.step import step_seed
    from sparse_rl_megatron.trainer.engine_pool.weight_probe import probe_tolerance
    from sparse_rl_megatron.utils.config_io import to_dict

    meta = {
        "model_path": cfg.model_path, "dataset": cfg.data.dataset, "template": plan.template, "reward": plan.reward,
        "engine": cfg.rollout.engine, "engine_dtype": cfg.rollout.dtype, "learner": measurement.learner,
        "world_size": D.env_world_size(), "prompts": cfg.rollout.prompts_per_step,
        "samples_per_prompt": cfg.rollout.samples_per_prompt, "sampling": to_dict(cfg.rollout.sampling),
        "sampler_seed": step_seed(cfg.seed, STUDY_STEP), "correction": to_dict(correction), "notes": notes,
        "probe_max_abs_diff": measurement.probe_max_abs_diff,
        "dense_tolerance": probe_tolerance(cfg, device_facts=plan.device_facts), "config": to_dict(cfg),
    }
    document = results_document(measurement, meta)
    path = write_results(document, json_path)
    table = build_table(document)
    if not console.is_terminal:  # a log file or a pipe: the whole table on one line per row
        console.width = max(console.width, console.measure(table, options=console.options.update_width(1000)).maximum)
    console.print(table)
    ok, line = dense_check(document)
    console.print(line if ok else f"[yellow]warning[/]: {line}")
    console.print(f"results written to {path}")
    if png_path is not None:
        console.print(f"log-rho histograms: {plot_histograms(document, png_path)}")
