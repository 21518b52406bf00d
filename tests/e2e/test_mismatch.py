"""``sparse-rl mismatch`` end to end: two torchrun ranks (the learner at TP 2, rank 0 drives the engine) measure a
tiny random Qwen2 on GSM8K prompts, dense and R-KV at two budgets, with the same prompts and sampler seed for every
row; the table, the results JSON and the histogram PNG hold every statistic, and the dense row is the engine's own
consistency check. Which budget shows the heavier tail is not asserted (a random model, four samples)."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("rollout/reward_mean", "rollout/response_len_mean", "rollout/truncated_frac", "rollout/kv_tokens_peak_mean",
        "rollout/kv_tokens_peak_max", "rollout/kv_tokens_dense_mean", "rollout/kv_retained_frac",
        "rollout/compression_events_mean", "rho/min", "rho/p0.1", "rho/p1", "rho/p5", "rho/p50", "rho/p99", "rho/max",
        "log_rho/abs_max", "log_rho/seq_sum_min", "sparse/rejected_token_frac", "sparse/vetoed_seq_frac",
        "sparse/rejected_seq_frac", "sparse/kl_k1", "time/rollout_s", "time/recompute_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_budgets_and_dense_under_torchrun_at_tp2(tmp_path, shared_data):
    env = {**os.environ, "SPARSE_RL_DATA": str(shared_data), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "sparse_rl_megatron.cli", "mismatch", f"run_dir={run_dir}",
           "--budgets", "12,24", "--prompts", "2", "--samples", "2", "--max-new-tokens", "16",
           "rollout.compression.window=2", "rollout.compression.buffer=4", "learner.tensor_parallel_size=2",
           "log.progress=false", "--plot"]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "Traceback" not in out.stderr

    # the table: a row per setting, printed once (by rank 0), and the dense consistency line
    header = next(line for line in out.stdout.splitlines() if "KV cache" in line)
    for column in ("reward", "resp len", "KV peak mean", "KV vs dense", "rho min", "p0.1", "p1", "p5", "p50", "p99",
                   "rejected tok", "vetoed seq"):
        assert column in header
    for label in ("dense", "rkv B=12", "rkv B=24"):
        assert sum(line.lstrip("│ ").startswith(label + " ") for line in out.stdout.splitlines()) == 1, label
    assert "the engine and the learner agree without compression" in out.stdout

    path = run_dir / "mismatch" / "rkv-B12-24.json"
    doc = json.loads(path.read_text())
    assert (run_dir / "mismatch" / "rkv-B12-24.png").read_bytes()[:4] == b"\x89PNG"
    meta = doc["meta"]
    assert meta["world_size"] == 2 and "TP=2" in meta["learner"] and meta["model_path"] == "tiny"
    assert meta["probe_max_abs_diff"] < 1e-3 and meta["correction"]["mode"] == "sparse_rl"
    rows = doc["rows"]
    assert [r["label"] for r in rows] == ["dense", "rkv B=12", "rkv B=24"]
    assert [r["compression"]["method"] for r in rows] == ["none", "rkv", "rkv"]
    assert [r["compression"]["budget"] for r in rows[1:]] == [12, 24]
    for row in rows:
        for key in KEYS:
            assert isinstance(row["stats"].get(key), float) and math.isfinite(row["stats"][key]), (row["label"], key)
        # the same prompts (and sampler seed) in every row; histogram counts every response token
        assert [(s["group"], s["source_id"]) for s in row["samples"]] == [
            (s["group"], s["source_id"]) for s in rows[0]["samples"]]
        assert sum(row["histogram"]) == sum(s["response_tokens"] for s in row["samples"]) > 0
    dense = rows[0]["stats"]
    assert dense["log_rho/abs_max"] < 1e-3 and dense["sparse/rejected_token_frac"] == 0.0
    assert dense["rollout/compression_events_mean"] == 0.0
    # dense holds every token but the last sampled one (never fed back): prompt + response - 1
    assert dense["rollout/kv_tokens_dense_mean"] - dense["rollout/kv_tokens_peak_mean"] == 1.0
    assert all(r["stats"]["rollout/compression_events_mean"] > 0 for r in rows[1:])

