"""``sparse-rl experiment`` end to end at tiny sizes: a dense, a compressed (Sparse-RL R-KV) and the supervised
control arm run from one shared warm start and write the metrics the figure needs; the table and the figure are
written; a re-run skips the complete arms (every arm is the base recipe plus its overrides, the same code path:
the other arms' configurations are checked in tests/unit/test_experiment_config.py, without a run each); a second experiment on a busy seed is refused; the issue-20
stages (budget rule, dose arm, compounding test, other caches, analysis) run end to end.
Nothing here says which arm wins (that is the experiment's job at full size)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "experiments" / "cpu_claims.yaml")
# 2 rollout steps of 2 prompts x 2 samples, a 5-step warm start, 4 held-out problems, a 2-step control; no
# per-arm PNG (the experiment's own figure is checked; a run's plot is drawn in tests/e2e/test_train.py)
TINY = ["train.steps=2", "train.warm_start={steps: 5, eval_problems: 0}", "train.eval.limit=4", "train.eval.every=0",
        "train.rollout.prompts_per_step=2", "train.rollout.samples_per_prompt=2", "train.global_batch_size=2",
        "experiment.control.steps=2", "train.log.plot=false"]
RL_ARMS = ("dense", "sparse_rl")
"""The RL arms run here: one dense, one compressed (the control's reference arm)."""
FIGURE_KEYS = ("rollout/reward_mean", "eval/dense/accuracy", "eval/sparse/accuracy", "train/grad_norm",
               "sparse/rejected_seq_frac", "loss/clip_frac", "sparse/rho_p1", "sparse/rho_p5",
               "rollout/repetition_rate", "rollout/kv_tokens_peak_mean", "rollout/kv_retained_frac")


def _experiment(capsys, out: Path, *extra: str, recipe: str = RECIPE) -> subprocess.CompletedProcess:
    """``sparse-rl experiment`` in this process (its arms, its ``sparse-rl mismatch`` runs are processes of their
    own, as always): the experiment's own process only prepares, dispatches and reports, and here it does not pay
    a process's imports for that. Exit status and what it printed, as a finished process."""
    from sparse_rl_megatron.cli import main

    capsys.readouterr()
    args = ["experiment", "--config", recipe, "--out", str(out), *(TINY if recipe == RECIPE else ()), *extra]
    code = main(args)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def _keys(run_dir: Path) -> set[str]:
    keys = set()
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        keys |= {k for k, v in json.loads(line).items() if v is not None}
    return keys


def test_every_arm_runs_and_the_table_and_figure_are_written_then_a_rerun_skips_them(tmp_path, capsys):
    out = tmp_path / "exp"
    first = _experiment(capsys, out, "--arms", *RL_ARMS, "sft")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    seed = out / "seed_0"
    warm = seed / "model" / "warm"
    for arm in RL_ARMS:
        cfg = yaml.safe_load((seed / arm / "config.yaml").read_text())
        assert cfg["model_path"] == str(warm)  # one warm start for all arms
        assert cfg["eval"]["compression"]["method"] == "rkv"  # every arm evaluated under the same sparse cache
        missing = set(FIGURE_KEYS) - _keys(seed / arm)
        assert not missing, f"{arm} lacks {missing}"
        assert json.loads((seed / arm / "arm_done.json").read_text())["cpu_seconds"] > 0
    modes = {arm: yaml.safe_load((seed / arm / "config.yaml").read_text()) for arm in RL_ARMS}
    assert modes["dense"]["rollout"]["compression"]["method"] == "none"
    assert modes["sparse_rl"]["correction"]["mode"] == "sparse_rl"
    assert modes["sparse_rl"]["rollout"]["compression"]["method"] == "rkv"
    assert {"eval/dense/accuracy", "eval/sparse/accuracy", "control/steps"} <= _keys(seed / "sft")
    assert (seed / "sft" / "model" / "config.json").is_file()

    results = json.loads((out / "results.json").read_text())
    assert set(results["arms"]) == {*RL_ARMS, "sft"}
    kv = {arm: results["arms"][arm]["mean"]["kv_ratio"] for arm in RL_ARMS}
    assert all(kv[arm] < kv["dense"] for arm in RL_ARMS[1:]), kv  # the compressed arms hold less KV
    table = (out / "results.md").read_text()
    assert all(f"| {arm} | 1 |" in table for arm in (*RL_ARMS, "sft"))
    assert (out / "figure.png").stat().st_size > 10_000

    again = _experiment(capsys, out, "--arms", *RL_ARMS, "sft")
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"arm {arm} already complete, skipped" in again.stdout for arm in (*RL_ARMS, "sft"))


def test_a_second_experiment_into_a_busy_directory_is_refused(tmp_path, capsys):
    from sparse_rl_megatron.trainer.runtime.run_dir import RunDirLock

    out = tmp_path / "exp"
    with RunDirLock(out / "seed_0"):  # one process per seed: another seed of the same experiment could run
        busy = _experiment(capsys, out)
    assert busy.returncode != 0
    assert f"run directory {out / 'seed_0'} is in use by pid {os.getpid()}" in busy.stderr


WEAK = str(ROOT / "configs" / "experiments" / "weak_claims.yaml")
WEAK_TINY = ["train.steps=2", "train.warm_start={steps: 5, eval_problems: 0}", "train.eval.limit=4",
             "train.eval.every=1", "train.rollout.prompts_per_step=2", "train.rollout.samples_per_prompt=2",
             "train.global_batch_size=2", "train.checkpoint.save_every=1", "train.learner.optim.lr_warmup_steps=0",
             "experiment.budget_rule={candidates: [4, 6], prompts: 2, samples: 2}",
             "experiment.study={checkpoint_steps: [2], prompts: 2, samples: 2}", "experiment.seeds=[0]",
             "train.log.plot=false"]


def _weak(capsys, out: Path, stage: str, *extra: str) -> subprocess.CompletedProcess:
    return _experiment(capsys, out, "--stage", stage, *WEAK_TINY, *extra, recipe=WEAK)


def test_stages_budget_rule_dose_arm_study_and_analysis(tmp_path, capsys):
    out = tmp_path / "weak"
    early = _weak(capsys, out, "arms", "--arms", "dense")
    assert early.returncode != 0 and "run the same command with --stage budgets first" in early.stderr
    budgets = _weak(capsys, out, "budgets")
    assert budgets.returncode == 0, budgets.stdout[-3000:] + budgets.stderr[-3000:]
    rule = json.loads((out / "budget_rule.json").read_text())
    assert rule["budget"] in (4, 6) and rule["harsh_budget"] == max(3, rule["budget"] // 2)
    assert [row["budget"] for row in rule["table"]] == [4, 6]
    arms = _weak(capsys, out, "arms", "--arms", "dense", "naive_harsh")
    assert arms.returncode == 0, arms.stdout[-3000:] + arms.stderr[-3000:]
    seed = out / "seed_0"
    harsh = yaml.safe_load((seed / "naive_harsh" / "config.yaml").read_text())
    assert harsh["rollout"]["compression"]["budget"] == rule["harsh_budget"]
    assert harsh["eval"]["compression"]["budget"] == rule["budget"]  # the main cache, for every arm
    keys = _keys(seed / "naive_harsh")
    assert {"sparse/would_veto_frac", "sparse/entropy_sampler", "eval/dense/modchain_weak/subset_rest/accuracy",
            "eval/dense/no_answer_frac"} <= keys
    study = _weak(capsys, out, "study", "--arms", "dense", "naive_harsh")
    assert study.returncode == 0, study.stdout[-3000:] + study.stderr[-3000:]
    for arm in ("dense", "naive_harsh"):
        assert (seed / arm / "study" / "mismatch_step_2.json").is_file()
        caches = json.loads((seed / arm / "study" / "caches.json").read_text())
        assert len(caches) == 4 and all("eval/sparse/accuracy" in m for m in caches.values())
    assert (seed / "study" / "mismatch_step_0.json").is_file()
    analysis = json.loads((out / "analysis.json").read_text())
    assert set(analysis["arms"]) == {"dense", "naive_harsh"} and "compounding" in analysis
    assert analysis["arms"]["dense"]["0"]["dense_start"] is not None
    assert "## Tests (pre-registered" in (out / "analysis.md").read_text()
