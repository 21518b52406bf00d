"""Run an experiment: per seed one shared warm start, then each arm as its own ``sparse-rl train`` run.

Layout of ``experiment.out``::

    experiment.yaml              the resolved experiment config
    seed_<s>/model/{init,warm}   the seed's task model and its warm start (built once, shared by every arm)
    seed_<s>/<arm>/              the arm's run directory (config.yaml, metrics.jsonl, checkpoints/, eval/, ...)
    seed_<s>/<arm>/arm.yaml      the arm's training recipe (``sparse-rl train --config`` reruns it alone)
    seed_<s>/<arm>/arm_done.json written when the arm is complete: a re-run skips it

An RL arm is the trainer itself (``sparse-rl train`` in a child process, so every arm starts from a clean
process: its own process group, Megatron state and signal handlers). A stopped arm (Ctrl-C, SIGTERM) saves
its checkpoint and the experiment stops; a re-run resumes that arm from it. Each seed directory is locked while a
process works on it: a second process on the same seed is refused, one on other seeds runs alongside.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from sparse_rl_megatron.experiment.arm_dirs import (ARM_DONE, ARM_RECIPE, ARM_USAGE, EXPERIMENT_FILE,
                                                    arm_train_config, read_json, seed_dir)
from sparse_rl_megatron.experiment.arms import arm_runs
from sparse_rl_megatron.experiment.config import ExperimentConfig
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.utils.config_io import to_dict
from sparse_rl_megatron.utils.errors import UserError
from dataclasses import replace
from sparse_rl_megatron.experiment.arms import ARMS
from sparse_rl_megatron.experiment.budget_rule import apply_budget_rule, run_budget_stage
from sparse_rl_megatron.experiment.control import run_control
from sparse_rl_megatron.experiment.results import write_report
from sparse_rl_megatron.observability.metrics_writer import METRICS_FILE, read_metrics
from sparse_rl_megatron.tasks import get_task
from sparse_rl_megatron.trainer.checkpointing.checkpoints import latest_checkpoint, read_state
from sparse_rl_megatron.trainer.runtime.model_dirs import prepare_model
from sparse_rl_megatron.trainer.runtime.run_dir import RunDirLock



class ArmStopped(UserError):
    """An arm ended before its last step (stopped or failed); a re-run resumes it."""

    exit_code = 130


def build_warm_start(cfg: ExperimentConfig, seed: int, log: Callable[[str], None]) -> Path:
    """The seed's task model and warm start in ``seed_<s>/model`` (built once, as ``sparse-rl train`` does)."""
    dirs = prepare_model(replace(cfg.train, seed=seed), get_task(cfg.train.model_path), seed_dir(cfg, seed))
    for note in dirs.notes:
        log(f"seed {seed}: {note}")
    return Path(dirs.learner)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _add_usage(run_dir: Path, cpu: float, wall: float) -> dict[str, float]:
    usage = read_json(run_dir / ARM_USAGE, {"cpu_seconds": 0.0, "wall_seconds": 0.0})
    usage = {"cpu_seconds": usage["cpu_seconds"] + cpu, "wall_seconds": usage["wall_seconds"] + wall}
    (run_dir / ARM_USAGE).write_text(json.dumps(usage) + "\n")
    return usage


def run_rl_arm(train_cfg: TrainConfig) -> dict[str, float]:
    """Run (or resume) one RL arm with ``sparse-rl train`` in a child process; returns its usage when it reached
    its last step, else raises ``ArmStopped``. Ctrl-C reaches the child, which saves and exits at the end of
    its step; this process waits for it."""
    run_dir = Path(train_cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe = run_dir / ARM_RECIPE
    recipe.write_text(yaml.safe_dump(to_dict(train_cfg), sort_keys=False))
    cmd = [sys.executable, "-m", "sparse_rl_megatron.cli", "train", "--config", str(recipe)]
    cpu0, wall0 = _children_cpu(), time.perf_counter()
    proc = subprocess.Popen(cmd)
    interrupted = False
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:  # the child got it too: it saves at the end of its step
            interrupted = True
    usage = _add_usage(run_dir, _children_cpu() - cpu0, time.perf_counter() - wall0)
    latest = latest_checkpoint(run_dir)
    step = read_state(latest).step if latest else 0
    if rc != 0 or step < train_cfg.steps:
        raise ArmStopped(f"arm {run_dir} ended at step {step} of {train_cfg.steps} (exit {rc}"
                         f"{', interrupted' if interrupted else ''}); rerun the same command to resume it")
    records = read_metrics(run_dir / METRICS_FILE)
    eval_wall = sum(r.get(MN.TIME_EVAL_S) or 0.0 for r in records)
    # CPU time outside evaluation: the process CPU time scaled by the wall-clock share of the other phases
    share = max(0.0, 1.0 - eval_wall / usage["wall_seconds"]) if usage["wall_seconds"] > 0 else 1.0
    return {**usage, "eval_wall_seconds": eval_wall, "train_cpu_seconds": usage["cpu_seconds"] * share,
            "steps": float(step)}


STAGES = ("arms", "warm", "budgets", "study", "report")
"""``warm``: the seeds' warm starts; ``budgets``: + the budget rule (``budget_rule.py``); ``arms`` (default): warm
starts + every arm + the report; ``study``: the compounding test and other caches (``study.py``) + the report;
``report``: tables and figures of what is complete."""


def _check_arms(cfg: ExperimentConfig) -> None:
    harsh = [a for a in cfg.experiment.arms if ARMS.get(a).harsh]
    if harsh and not cfg.experiment.harsh_budget:
        raise UserError(f"experiment.harsh_budget is not set for the dose arm(s) {', '.join(harsh)}")
    leveled = [a for a in cfg.experiment.arms if ARMS.get(a).level not in (None, *cfg.experiment.level_budgets)]
    if leveled:
        raise UserError(f"experiment.level_budgets has no budget for the level of the arm(s) {', '.join(leveled)} "
                        f"(got {cfg.experiment.level_budgets}); run --stage budgets first")


def run_experiment(cfg: ExperimentConfig, log: Callable[[str], None] = print, stage: str = "arms") -> Path:
    """Run ``stage`` (``STAGES``) for every seed: what is complete is skipped. Each seed directory is locked
    while it runs, so two processes can take disjoint seeds of one experiment. Returns the experiment
    directory."""
    if stage not in STAGES:
        raise UserError(f"--stage must be one of {', '.join(STAGES)}, got '{stage}'")
    out = Path(cfg.experiment.out)
    if stage in ("arms", "study", "report"):
        cfg = apply_budget_rule(cfg)
    runs = arm_runs(cfg.experiment.arms, cfg.experiment.budgets)
    if stage in ("arms", "study"):
        _check_arms(cfg)
        for seed in cfg.experiment.seeds:  # every arm's recipe is valid before anything runs
            for run in runs:
                arm_train_config(cfg, run, seed)
    out.mkdir(parents=True, exist_ok=True)
    if stage != "report":
        (out / EXPERIMENT_FILE).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    warm_dirs: dict[int, Path] = {}
    for seed in cfg.experiment.seeds if stage != "report" else []:
        with RunDirLock(seed_dir(cfg, seed)):
            warm = warm_dirs[seed] = build_warm_start(cfg, seed, log)
            if stage == "study":
                from sparse_rl_megatron.experiment.study import run_study

                run_study(cfg, seed, warm, log)
            if stage != "arms":
                continue
            for run in runs:
                train_cfg = arm_train_config(cfg, run, seed, warm)
                run_dir = Path(train_cfg.run_dir)
                if (run_dir / ARM_DONE).is_file():
                    log(f"seed {seed}: arm {run.name} already complete, skipped")
                    continue
                budget = run.budget or run.spec.harsh or run.spec.level
                log(f"seed {seed}: arm {run.name} ({run.spec.description}"
                    f"{f', budget {train_cfg.rollout.compression.budget}' if budget else ''})"
                    f" in {run_dir}")
                if run.spec.supervised:
                    done = run_control(cfg, train_cfg, seed, warm, log)
                else:
                    done = run_rl_arm(train_cfg)
                done.update(arm=run.arm, seed=seed, rollout_kv=train_cfg.rollout.compression.describe())
                (run_dir / ARM_DONE).write_text(json.dumps(done, indent=1) + "\n")
                log(f"seed {seed}: arm {run.name} done in {done['cpu_seconds']:.0f} CPU s")
    if stage == "budgets":
        run_budget_stage(cfg, warm_dirs, log)
    if stage in ("arms", "study", "report"):
        table, figure = write_report(cfg)
        log(f"results: {table}  figure: {figure}")
    return out
