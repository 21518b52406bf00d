"""``--stage study``: what the arms' models became, measured after the runs.

- **Compounding test**: ``sparse-rl mismatch`` at the main cache (B*) on the seed's warm start (step 0, once per
  seed) and on each complete RL arm's checkpoints at ``study.checkpoint_steps``: the same first prompts and
  sampler seed every time, so the would-be veto rate and rho's tail compare across steps and arms. Files:
  ``seed_<s>/study/mismatch_step_0.json``, ``seed_<s>/<arm>/study/mismatch_step_<k>.json``.
- **Robustness**: each complete arm's final model (the RL arms' last checkpoint exported to HF, the control's
  model) evaluated greedily on the held-out problems under each of ``study.caches``:
  ``seed_<s>/<arm>/study/caches.json`` (``{cache: eval metrics}``).

Everything is skipped when its file exists, so the stage resumes where it stopped.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from sparse_rl_megatron.experiment.arm_dirs import ARM_DONE, arm_train_config, seed_dir
from sparse_rl_megatron.experiment.arms import arm_runs
from sparse_rl_megatron.experiment.budget_rule import run_mismatch
from sparse_rl_megatron.experiment.config import ExperimentConfig
from sparse_rl_megatron.experiment.control import CONTROL_MODEL
from sparse_rl_megatron.experiment.saved_eval import evaluate_saved
from sparse_rl_megatron.trainer.checkpointing.checkpoints import step_dir
from sparse_rl_megatron.utils.config_io import to_dict

STUDY_DIR = "study"
CACHES_FILE = "caches.json"
FINAL_HF = "final_hf"


def mismatch_file(arm_dir: Path | None, seed_dir: Path, step: int) -> Path:
    """Where the compounding test of ``step`` is written (step 0: the seed's warm start, shared by the arms)."""
    return (seed_dir if step == 0 else arm_dir) / STUDY_DIR / f"mismatch_step_{step}.json"


def _study_recipe(cfg: ExperimentConfig, run, seed: int, model: Path) -> dict:
    """The train recipe the mismatch study measures: the arm's, on ``model``, with the main compressed cache."""
    data = to_dict(arm_train_config(cfg, run, seed, model))
    data["rollout"]["compression"] = to_dict(cfg.train.rollout.compression)
    return data


def compounding(cfg: ExperimentConfig, seed: int, warm: Path, runs: list, log: Callable[[str], None]) -> None:
    study = cfg.experiment.study
    budget = [cfg.train.rollout.compression.budget]
    sdir = seed_dir(cfg, seed)
    rl = [r for r in runs if not r.spec.supervised and (sdir / r.name / ARM_DONE).is_file()]
    if not rl:
        return
    out0 = mismatch_file(None, sdir, 0)
    run_mismatch(_study_recipe(cfg, rl[0], seed, warm), out0.parent / "step_0", out0, budget, study.prompts,
                 study.samples, log)
    for run in rl:
        arm_dir = sdir / run.name
        for step in study.checkpoint_steps:
            out = mismatch_file(arm_dir, sdir, step)
            ckpt = step_dir(arm_dir, step)
            if out.is_file():
                continue
            if not ckpt.is_dir():
                log(f"seed {seed}: {run.name} has no checkpoint at step {step}; compounding test skipped there")
                continue
            run_mismatch(_study_recipe(cfg, run, seed, ckpt), out.parent / f"step_{step}", out, budget,
                         study.prompts, study.samples, log)


def final_model(arm_dir: Path, supervised: bool, steps: int) -> Path | None:
    """The HF directory of an arm's final model (the RL arms' step-``steps`` checkpoint exported once)."""
    if supervised:
        path = arm_dir / CONTROL_MODEL
        return path if path.is_dir() else None
    out = arm_dir / STUDY_DIR / FINAL_HF
    if not out.is_dir():
        ckpt = step_dir(arm_dir, steps)
        if not ckpt.is_dir():
            return None
        from sparse_rl_megatron.learner.convert import export_to_hf

        export_to_hf(ckpt, out)
    return out


def robustness(cfg: ExperimentConfig, seed: int, runs: list, log: Callable[[str], None]) -> None:
    """Every complete arm's final model under each of ``study.caches`` (greedy, the recipe's held-out set)."""
    caches = cfg.experiment.study.caches
    if not caches:
        return
    sdir = seed_dir(cfg, seed)
    for run in runs:
        arm_dir = sdir / run.name
        path = arm_dir / STUDY_DIR / CACHES_FILE
        if path.is_file() or not (arm_dir / ARM_DONE).is_file():
            continue
        model = final_model(arm_dir, run.spec.supervised, cfg.train.steps)
        if model is None:
            log(f"seed {seed}: {run.name} has no final model; robustness skipped")
            continue
        base = arm_train_config(cfg, run, seed, model)
        sparse = dataclasses.replace(base, eval=dataclasses.replace(base.eval, modes=["sparse"]))
        works = [arm_dir / STUDY_DIR / "caches" / c.describe().replace(" ", "_").replace("=", "") for c in caches]
        metrics = evaluate_saved(sparse, model, cfg.train.steps, list(zip(caches, works)))
        results = {cache.describe(): m for cache, m in zip(caches, metrics)}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
        log(f"seed {seed}: {run.name} evaluated under {len(caches)} other caches")


def run_study(cfg: ExperimentConfig, seed: int, warm: Path, log: Callable[[str], None]) -> None:
    """The compounding test, then robustness, of one seed (cut order: compounding first)."""
    runs = arm_runs(cfg.experiment.arms, cfg.experiment.budgets)
    compounding(cfg, seed, warm, runs, log)
    robustness(cfg, seed, runs, log)
