"""`sparse-rl smoke` (the embedded CPU default) runs every stage of a Sparse-RL step end to end."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_runs_all_stages_and_writes_outputs(tmp_path, shared_data):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sparse_rl_megatron.cli", "smoke", "--config", str(ROOT / "configs/cpu_default.yaml"),
           f"run_dir={run_dir}", "steps=2", "prompts_per_step=2", "samples_per_prompt=2",
           "sampling.max_new_tokens=24", "compression.budget=16", "compression.window=2", "compression.buffer=4"]
    env = {**os.environ, "SPARSE_RL_DATA": str(shared_data), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        # rollout on a compressed cache really compressed, the correction saw 4 samples, the learner stepped
        assert r["rollout/compression_events_mean"] > 0 and r["rollout/peak_kv_tokens_max"] > 0
        assert r["sparse/num_seqs"] == 4 and 0 <= r["sparse/rejected_token_frac"] <= 1
        assert math.isfinite(r["sparse/rho_p1"]) and math.isfinite(r["sparse/kl_k3"])
        assert r["train/skipped"] == 0 and math.isfinite(r["train/grad_norm"])
    assert records[1]["train/step"] == 2
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert (run_dir / "checkpoint" / "sparse_rl_checkpoint.json").is_file()
    assert any((run_dir / "tensorboard").iterdir())
    # a second run starts clean and keeps the first run's outputs under archive/
    out = subprocess.run(cmd + ["steps=1"], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    (archived,) = (run_dir / "archive").iterdir()
    assert len((archived / "metrics.jsonl").read_text().splitlines()) == 2
    assert (archived / "checkpoint" / "sparse_rl_checkpoint.json").is_file()


def test_smoke_refuses_bad_config(tmp_path):
    cmd = [sys.executable, "-m", "sparse_rl_megatron.cli", "smoke", "steps=0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0 and "SmokeConfig.steps must be >= 1, got 0" in out.stderr
    assert "Traceback" not in out.stderr  # a bad config is a one-line message, not a crash
    cmd = [sys.executable, "-m", "sparse_rl_megatron.cli", "smoke", "compression.method=zip"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0 and "compression: CompressionConfig.method: unknown" in out.stderr
    assert "rkv" in out.stderr and "snapkv" in out.stderr and "Traceback" not in out.stderr
