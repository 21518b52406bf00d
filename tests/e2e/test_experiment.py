"""``sparse-rl experiment`` end to end at tiny sizes: every arm (dense, naive, Sparse-RL R-KV and SnapKV, the
supervised control) runs from one shared warm start and writes the metrics the figure needs; the table and the
figure are written; a re-run skips the complete arms; a second experiment into a busy directory is refused.
Nothing here says which arm wins (that is the experiment's job at full size)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "experiments" / "cpu_claims.yaml")
# 2 rollout steps of 2 prompts x 2 samples, a 5-step warm start, 4 held-out problems, a 2-step control
TINY = ["train.steps=2", "train.warm_start={steps: 5, eval_problems: 0}", "train.eval.limit=4", "train.eval.every=0",
        "train.rollout.prompts_per_step=2", "train.rollout.samples_per_prompt=2", "train.global_batch_size=2",
        "experiment.control.steps=2"]
RL_ARMS = ("dense", "naive", "sparse_rl", "sparse_rl_snapkv")
FIGURE_KEYS = ("rollout/reward_mean", "eval/dense/accuracy", "eval/sparse/accuracy", "train/grad_norm",
               "sparse/rejected_seq_frac", "loss/clip_frac", "sparse/rho_p1", "sparse/rho_p5",
               "rollout/repetition_rate", "rollout/kv_tokens_peak_mean", "rollout/kv_retained_frac")


def _experiment(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT),
           "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "sparse_rl_megatron.cli", "experiment", "--config", RECIPE, "--out", str(out),
           *TINY, *extra]
    return subprocess.run(cmd, env=env, cwd=out.parent, capture_output=True, text=True, timeout=600)


def _keys(run_dir: Path) -> set[str]:
    keys = set()
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        keys |= {k for k, v in json.loads(line).items() if v is not None}
    return keys


def test_every_arm_runs_and_the_table_and_figure_are_written_then_a_rerun_skips_them(tmp_path):
    out = tmp_path / "exp"
    first = _experiment(out)
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
    assert modes["naive"]["correction"]["mode"] == "none"
    assert modes["sparse_rl"]["correction"]["mode"] == "sparse_rl"
    assert modes["sparse_rl_snapkv"]["rollout"]["compression"]["method"] == "snapkv"
    assert {"eval/dense/accuracy", "eval/sparse/accuracy", "control/steps"} <= _keys(seed / "sft")
    assert (seed / "sft" / "model" / "config.json").is_file()

    results = json.loads((out / "results.json").read_text())
    assert set(results["arms"]) == {*RL_ARMS, "sft"}
    kv = {arm: results["arms"][arm]["mean"]["kv_ratio"] for arm in RL_ARMS}
    assert all(kv[arm] < kv["dense"] for arm in RL_ARMS[1:]), kv  # the compressed arms hold less KV
    table = (out / "results.md").read_text()
    assert all(f"| {arm} | 1 |" in table for arm in (*RL_ARMS, "sft"))
    assert (out / "figure.png").stat().st_size > 10_000

    again = _experiment(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"arm {arm} already complete, skipped" in again.stdout for arm in (*RL_ARMS, "sft"))


def test_a_second_experiment_into_a_busy_directory_is_refused(tmp_path):
    from sparse_rl_megatron.utils.run_dir import RunDirLock

    out = tmp_path / "exp"
    with RunDirLock(out):
        busy = _experiment(out)
    assert busy.returncode != 0
    assert f"run directory {out} is in use by pid {os.getpid()}" in busy.stderr
