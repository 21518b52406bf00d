"""The paper's 1.5B R-KV recipe, scaled down by overrides only (docs/training.md, "Trying a recipe on a laptop"),
trains SmolLM2-135M-Instruct for 2 steps on GSM8K with each engine in bfloat16 against the float32 learner, the
weight-sync probe on: every phase on a real model and tokenizer (R-KV compresses; dense and sparse evaluation).
The sglang run's evaluation is also the tier's check of SGLang's bf16 engine with the sparse_kv plugin on real
weights as ``sparse-rl eval --engine sglang`` samples them (the trainer's evaluation and the command share
``eval.runner.sample_problems``; the command's own arguments with ``--engine sglang`` are tested on the tiny model
in tests/sglang/test_http_and_eval.py): one SGLang start for the tier instead of two."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from realmodel_helpers import ROOT, env

from sparse_rl_megatron.trainer.engine_pool.weight_probe import PROBE_TOLERANCE_16BIT

RECIPE = str(ROOT / "configs" / "recipes" / "qwen2.5-1.5b" / "rkv.yaml")
SCALED = ["launch.gpus=1", "steps=2", "data.dataset=gsm8k_train", "rollout.prompts_per_step=1",
          "rollout.samples_per_prompt=2", "global_batch_size=2", "rollout.sampling.max_new_tokens=24",
          "rollout.compression.budget=16", "rollout.compression.buffer=8", "eval.every=0", "eval.at_start=false",
          "eval.datasets=[gsm8k]", "eval.limit=1", "eval.max_new_tokens=16", "checkpoint.save_every=0",
          "log.plot=false", "log.tensorboard=false"]
"""The last two leave out what this tier need not prove (matplotlib's drawing, TensorBoard's writer: seconds of
import and drawing per run; tests/unit covers both); the checkpoint of the last step is still written."""


@pytest.mark.parametrize("engine", ["sglang", "hf"])
def test_scaled_recipe_trains_two_steps(smollm2, shared_data, run_root, engine):
    run_dir = run_root / "run"
    cmd = [sys.executable, "-m", "sparse_rl_megatron.cli", "train", "--config", RECIPE, f"model_path={smollm2}",
           f"run_dir={run_dir}", *SCALED, *(["rollout.engine=hf"] if engine == "hf" else [])]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(), "SPARSE_RL_DATA": str(shared_data)}, text=True,
                          capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (config["rollout"]["engine"], config["rollout"]["dtype"], config["launch"]["layout"]) == (
        engine, "bfloat16", "")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # bf16 engine vs fp32 learner: the probe's mean within the noise bound the stale check relies on
        assert 0 < r["sync/probe_mean_abs_diff"] < PROBE_TOLERANCE_16BIT / 2, r
        assert r["rollout/weight_version"] == r["step"] - 1 and r["rollout/compression_events_mean"] > 0
        assert r["train/optimizer_steps"] == 1 and r["rollout/response_len_mean"] > 0
    assert {"eval/dense/gsm8k/accuracy", "eval/sparse/gsm8k/accuracy"} <= set(records[-1])
    assert "serves the learner's weights (version 0)" in proc.stdout
    if engine == "sglang":  # on CPU the engine runs 256 requests at most, and the plugin reserves for those rows only
        assert "GiB for 257 rows" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    assert os.path.isdir(run_dir / "checkpoints" / "step_2")
    for mode in ("dense", "sparse"):  # the final evaluation's samples: real text, compressed only in sparse mode
        record = json.loads((run_dir / "eval" / f"step_2.{mode}.json").read_text())
        samples = [p["samples"][0] for p in record["benchmarks"]["gsm8k"]["problems"]]
        assert samples and all(sum(c.isalpha() for c in s["response"]) > 20 for s in samples), samples
        assert all((s["compression_events"] > 0) == (mode == "sparse") for s in samples), samples
