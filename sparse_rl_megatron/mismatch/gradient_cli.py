"""``sparse-rl gradients``: the gradient of each correction on compressed rollouts vs the dense on-policy gradient.

    sparse-rl gradients [--config RECIPE.yaml] [key.path=value ...] --budgets 8,10 [--modes none,sparse_rl]
                        [--prompts 64] [--samples 8] [--reference-samples 32] [--repeats 3] [--output FILE.json]

At the recipe's model (a ``task:`` warm start is built or reused exactly as ``sparse-rl train`` does), on the run's
first ``--prompts`` training prompts: the reference gradient from a dense batch of ``--reference-samples`` per prompt,
then ``--repeats`` times (each its own sampler seed) the dense row and every (budget, mode) row at ``--samples`` per
prompt, each as its cosine to the reference (``mismatch/gradient.py``). One process; HF models (a task's, or an HF
directory).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from sparse_rl_megatron.mismatch.cli import STUDY_OVERRIDES, parse_budgets
from sparse_rl_megatron.utils.errors import UserError

MODES = ("none", "sparse_rl")
"""Correction modes compared by default: naive (no correction) and Sparse-RL."""
REFERENCE_SEED_OFFSET = 7_919
"""The reference batch's sampler seed: the recipe's seed plus this (the repeats use seed + 1, 2, ...)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="train recipe YAML (default: the embedded CPU default)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of the recipe")
    parser.add_argument("--budgets", default=None, help="comma-separated KV budgets (default: the recipe's)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"correction modes, comma-separated (default: "
                                                                 f"{','.join(MODES)})")
    parser.add_argument("--prompts", type=int, default=64, help="the run's first training prompts (default: 64)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt of every row (default: 8)")
    parser.add_argument("--reference-samples", type=int, default=32,
                        help="samples per prompt of the dense reference batch (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="independent draws of every row (default: 3)")
    parser.add_argument("--output", required=True, help="results JSON")
    parser.parse_args = parser.parse_intermixed_args


def _check(args: argparse.Namespace) -> list[str]:
    from sparse_rl_megatron.algo.modes import CORRECTION_MODES

    for name in ("prompts", "samples", "reference_samples", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.samples < 2 or args.reference_samples < 2:
        raise UserError("--samples and --reference-samples must be >= 2 (GRPO's advantages need a group)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in CORRECTION_MODES.names()]
    if unknown or not modes:
        raise UserError(f"--modes: unknown correction mode(s) {', '.join(unknown) or '(none given)'}; valid: "
                        f"{', '.join(CORRECTION_MODES.names())}")
    if Path(args.output).is_dir():
        raise UserError(f"--output: {args.output} is a directory; give the results file's path")
    return modes


def run(args: argparse.Namespace) -> int:
    import torch

    from sparse_rl_megatron.data.templates import render_prompt
    from sparse_rl_megatron.mismatch.gradient import align, policy_gradient
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
    from sparse_rl_megatron.trainer.cli import load
    from sparse_rl_megatron.trainer.run import make_reward
    from sparse_rl_megatron.trainer.run_plan import preflight
    from sparse_rl_megatron.trainer.runtime.model_dirs import prepare_model
    from sparse_rl_megatron.trainer.runtime.prompts import PromptOrder
    from sparse_rl_megatron.utils.atomic_write import write_json_atomic

    modes = _check(args)
    cfg = load(argparse.Namespace(config=args.config, overrides=[*args.overrides, *STUDY_OVERRIDES]))
    compression = cfg.rollout.compression
    if compression.is_dense:
        raise UserError("rollout.compression.method is dense: name the compressor whose rollouts to measure")
    budgets = parse_budgets(args.budgets, compression.budget)
    plan = preflight(cfg, 1, lengths=("rollout",))
    dirs = prepare_model(cfg, plan.task, Path(cfg.run_dir))
    for note in dirs.notes:
        print(note, flush=True)
    model_dir = Path(dirs.engine_hf or dirs.learner)
    if not (model_dir / "config.json").is_file():
        raise UserError(f"sparse-rl gradients takes HF models; {model_dir} is not one (convert it first)")
    torch.manual_seed(cfg.seed)
    engine = HFRolloutEngine(model_dir, dtype=torch.float32, show_progress=False)
    tokenizer = engine.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    records = PromptOrder(plan.train_data.records, cfg.seed, cfg.data.shuffle).take(args.prompts)
    prompts = [render_prompt(plan.template, r.prompt, tokenizer) for r in records]
    plain = dataclasses.replace(cfg.correction, mode="none")
    corrections = {m: dataclasses.replace(cfg.correction, mode=m) for m in modes}

    with make_reward(cfg, plan) as reward:
        def draw(n: int, seed: int, comp):
            samples = engine.generate(prompts, n, dataclasses.replace(cfg.rollout.sampling, seed=seed),
                                      compression=comp)
            for s in samples:
                s.metadata.update(records[s.group_id].metadata())
            reward.score_samples(samples)
            return samples

        dense = dataclasses.replace(compression, method="none")
        print(f"reference: dense, {args.prompts} prompts x {args.reference_samples} samples", flush=True)
        reference, _ = policy_gradient(engine.model, draw(args.reference_samples, cfg.seed + REFERENCE_SEED_OFFSET,
                                                          dense), plain, cfg.learner.loss, pad_id)
        check_reference(reference, args.prompts, args.reference_samples)
        rows: dict[str, list[dict]] = {}
        for r in range(args.repeats):
            seed = cfg.seed + 1 + r
            samples = draw(args.samples, seed, dense)
            g, kept = policy_gradient(engine.model, samples, plain, cfg.learner.loss, pad_id)
            rows.setdefault("dense", []).append({**dataclasses.asdict(align(g, reference, kept)),
                                                 "reward": _mean_reward(samples)})
            for b in budgets:
                samples = draw(args.samples, seed, dataclasses.replace(compression, budget=b))
                for m in modes:
                    g, kept = policy_gradient(engine.model, samples, corrections[m], cfg.learner.loss, pad_id)
                    rows.setdefault(f"{compression.method} B={b} {m}", []).append(
                        {**dataclasses.asdict(align(g, reference, kept)), "reward": _mean_reward(samples)})
            print(f"repeat {r + 1}/{args.repeats}: " + "  ".join(f"{k} {v[-1]['cosine']:.3f}" for k, v in rows.items()),
                  flush=True)
    summary = {k: {f: _mean_sd([x[f] for x in v]) for f in ("cosine", "norm_ratio", "kept_tokens", "reward")}
               for k, v in rows.items()}
    document = {"model": str(model_dir), "compression": dataclasses.asdict(compression), "budgets": budgets,
                "modes": modes, "prompts": args.prompts, "samples": args.samples,
                "reference_samples": args.reference_samples, "repeats": args.repeats, "seed": cfg.seed,
                "rows": rows, "summary": summary}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, document)
    print(f"{'row':32s} {'cos to dense ref':>18s} {'|g|/|g_ref|':>14s} {'tokens kept':>12s} {'reward':>8s}")
    for k, s in summary.items():
        print(f"{k:32s} {_fmt(s['cosine']):>18s} {_fmt(s['norm_ratio']):>14s} {_fmt(s['kept_tokens']):>12s} "
              f"{_fmt(s['reward']):>8s}")
    print(f"results written to {out}")
    return 0


def check_reference(reference, prompts: int, samples: int) -> None:
    """Refuse a reference gradient of zero (no direction to compare with: every group's rewards were equal)."""
    if not float(reference.norm()) > 0:
        raise UserError(f"the dense reference batch ({prompts} prompts x {samples} samples) has no gradient: every "
                        "prompt's samples got the same reward; give more --prompts or --reference-samples")


def _mean_reward(samples) -> float:
    return sum(float(s.reward) for s in samples) / len(samples)


def _mean_sd(values: list[float]) -> list[float]:
    return [statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0]


def _fmt(pair: list[float]) -> str:
    return f"{pair[0]:.3f} +- {pair[1]:.3f}"
