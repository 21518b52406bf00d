"""Mixtures of experts end to end on CPU: ``sparse-rl train`` of a tiny random Qwen3-MoE at EP 2 (two ranks under
torchrun, DP 2, one HF engine each, the weight-sync probe on every step, dense and sparse evaluations, the
load-balancing loss logged; the same run with ``learner.offload: all`` bit for bit the same), resumed at PP 2 x EP 2 on four ranks from its step-2 checkpoint; ``sparse-rl eval``
of the trained Megatron checkpoint (exported to HF, experts unstacked); ``sparse-rl mismatch`` of a tiny Qwen2-MoE
with the routing share of the rho tail; a tiny Qwen2-MoE trained at EP 2, resumed, converted to HF and back. (The SGLang
engine's MoE run: tests/sglang/test_train_sglang_moe.py.)"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from test_train import RECIPE, SMALL, _comparable, _env, _flat, _model_state, _records, free_port

from sparse_rl_megatron.mismatch.routing import REPLAY_KEYS

MOE = ["plugins=[train_task_plugin]", "data.dataset=task:tiny_sums", "warm_start={}", "reward.name=parity",
       "learner.expert_parallel_size=2"]


def _torchrun(nproc: int, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port()), "-m", "sparse_rl_megatron.cli", "train", "--config", RECIPE, f"run_dir={run_dir}",
            *SMALL, *MOE, *overrides]


def test_ep2_trains_resumes_at_pp2_x_ep2_and_evaluates(tmp_path, shared_data):
    env, run_dir = _env(shared_data), tmp_path / "run"
    first = subprocess.run(_torchrun(2, run_dir, "model_path=tiny-qwen3-moe", "steps=2"), env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "built tiny random qwen3_moe" in first.stdout
    assert "qwen3_moe L=2 H=64 TP=1 PP=1 DP=2 experts=4 top-2 EP=2 ETP=1" in first.stdout
    assert "on all 2 engines: probe mean" in first.stdout
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["sync/probe_max_abs_diff"] < 1e-3 and r["rollout/weight_version"] == r["step"] - 1
        # the checkpoint's router_aux_loss_coef (0.001) turns megatron's load-balancing loss on: ~1 when balanced
        assert 0.5 < r["train/moe_load_balancing_loss"] < 4 and math.isfinite(r["train/grad_norm"])
    assert any(r["loss/pg"] != 0 for r in records[1:])  # parity rewards: the groups carry a signal

    # the same run with the learner asleep between its turns (learner.offload: all): bit for bit the same
    asleep_dir = tmp_path / "offload"
    asleep = subprocess.run(_torchrun(2, asleep_dir, "model_path=tiny-qwen3-moe", "steps=2", "learner.offload=all"),
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert asleep.returncode == 0, asleep.stdout[-3000:] + asleep.stderr[-3000:]
    assert "EP=2 ETP=1" in asleep.stdout and "offload=all" in asleep.stdout
    assert [_comparable(r) for r in _records(asleep_dir)] == [_comparable(r) for r in records]
    want, got = (dict(_flat(_model_state(d / "checkpoints" / "step_2"))) for d in (run_dir, asleep_dir))
    assert sorted(want) == sorted(got) and any("optimizer" in key for key in want)
    assert all((v == got[k]).all() if hasattr(v, "shape") else v == got[k] for k, v in want.items())

    # the same command at PP 2 x EP 2 on four ranks resumes from step 2 (the checkpoint reshards)
    second = subprocess.run(_torchrun(4, run_dir, "model_path=tiny-qwen3-moe", "steps=3",
                                      "learner.pipeline_parallel_size=2"),
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout and "step_2" in second.stdout, second.stdout[-3000:]
    assert "TP=1 PP=2 DP=2 experts=4 top-2 EP=2 ETP=1" in second.stdout
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[-1]["sync/probe_max_abs_diff"] < 1e-3 and records[-1]["rollout/weight_version"] == 2
    evals = sorted(p.name for p in (run_dir / "eval").glob("*.json"))
    assert {"step_3.dense.json", "step_3.sparse.json"} <= set(evals)

    # sparse-rl eval of the trained Megatron checkpoint: exported to HF (experts unstacked), evaluated with R-KV
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "sparse_rl_megatron.cli", "eval", "--model",
                           str(run_dir / "checkpoints" / "step_3"), "--data-root", str(shared_data), "--benchmarks",
                           "gsm8k", "--limit", "2", "--n", "1", "--max-new-tokens", "12", "--compression", "rkv",
                           "--budget", "16", "--no-progress", "--verifier-workers", "1", "--output", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    samples = [s for p in result["benchmarks"]["gsm8k"]["problems"] for s in p["samples"]]
    assert len(samples) == 2 and all(s["response"] for s in samples)


def test_mismatch_splits_the_tail_into_attention_and_routing(tmp_path, shared_data):
    """A tiny Qwen2-MoE (shared expert), dense and R-KV at one budget: the dense row agrees with the learner; the
    compressed row sends part of its tokens to other experts, and its replay routed as the dense model routes is
    measured alongside (the HF engine replays its own samples exactly)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sparse_rl_megatron.cli", "mismatch", f"run_dir={run_dir}", "--budgets", "12",
           "--prompts", "2", "--samples", "2", "--max-new-tokens", "16", "--model", "tiny-qwen2-moe", "--dataset",
           "gsm8k_train", "--template", "qwen25_chat", "rollout.compression.scope=all",
           "rollout.compression.window=2", "rollout.compression.buffer=4", "log.progress=false"]
    out = subprocess.run(cmd, env=_env(shared_data), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    header = next(line for line in out.stdout.splitlines() if "KV cache" in line)
    assert "routing flips" in header and "contaminated, dense routing" in header
    dense, compressed = json.loads((run_dir / "mismatch" / "rkv-B12.json").read_text())["rows"]
    assert dense["stats"]["log_rho/abs_max"] < 1e-3
    # fp32: the sampler's recorded routes are the learner's own (no flip), so replaying them changes nothing
    assert {k for k in dense["stats"] if k.startswith("moe/")} == set(REPLAY_KEYS)
    assert dense["stats"]["moe/learner_flip_frac"] == dense["stats"]["moe/learner_prompt_flip_frac"] == 0
    assert dense["stats"]["moe/log_rho_abs_max_replay"] < 1e-3
    stats = compressed["stats"]
    assert stats["rollout/compression_events_mean"] > 0
    assert 0 < stats["moe/routing_flip_frac"] <= stats["moe/token_flip_frac"] <= 1
    assert stats["moe/replay_max_abs_diff"] == 0.0
    assert 0 <= stats["moe/contaminated_frac_dense_routing"] <= 1
    assert stats["moe/routing_contamination"] == stats["sparse/contaminated_frac"] - stats[
        "moe/contaminated_frac_dense_routing"]
    assert 0 < stats["moe/rho_min_dense_routing"] <= stats["moe/rho_p1_dense_routing"]


def test_mismatch_in_bf16_reports_routing_flips_and_replay(tmp_path, shared_data):
    """Sampler and learner both in bf16 on CPU (the learner computes log-probs only): near-tied top-k choices break
    differently in the two, and the study reports it for every row, dense included (``routing.replay_split``), with the
    tail when the recompute replays the sampler's routes (R3): without compression replay leaves only the rounding."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sparse_rl_megatron.cli", "mismatch", f"run_dir={run_dir}", "--budgets", "12",
           "--prompts", "2", "--samples", "2", "--max-new-tokens", "16", "--model", "tiny-qwen3-moe", "--dataset",
           "gsm8k_train", "--template", "qwen25_chat", "rollout.compression.scope=response",
           "rollout.compression.window=2", "rollout.compression.buffer=4", "rollout.dtype=bfloat16",
           "learner.params_dtype=bfloat16", "log.progress=false"]
    out = subprocess.run(cmd, env=_env(shared_data), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    header = next(line for line in out.stdout.splitlines() if "KV cache" in line)
    assert "flips vs learner" in header and "max |log rho|, replay" in header
    doc = json.loads((run_dir / "mismatch" / "rkv-B12.json").read_text())
    assert "dtype=torch.bfloat16" in doc["meta"]["learner"] and doc["meta"]["engine_dtype"] == "bfloat16"
    dense, compressed = doc["rows"]
    for row in (dense, compressed):
        stats = row["stats"]
        assert all(0 <= stats[k] <= 1 for k in ("moe/learner_flip_frac", "moe/learner_token_flip_frac",
                                                "moe/learner_prompt_flip_frac", "moe/contaminated_frac_replay"))
        assert stats["moe/learner_flip_frac"] <= stats["moe/learner_token_flip_frac"]
    d = dense["stats"]
    assert d["moe/learner_prompt_flip_frac"] + d["moe/learner_flip_frac"] > 0  # bf16 routers disagree somewhere
    assert d["moe/log_rho_abs_max_replay"] < d["log_rho/abs_max"]  # replay removes the flips' share of the tail
    assert d["moe/log_rho_abs_max_replay"] < 0.5  # what is left: bf16 rounding of the same routing


def test_qwen2_moe_trains_at_ep2_resumes_and_converts(tmp_path, shared_data):
    """A tiny Qwen2-MoE (gated shared expert) at EP 2: one step with dense and sparse evaluations, then the same
    command resumes to a second; its checkpoint converts to HF with ``sparse-rl convert`` and back, bit for bit."""
    from safetensors.torch import load_file

    env, run_dir = _env(shared_data), tmp_path / "run"
    for steps in (1, 2):
        proc = subprocess.run(_torchrun(2, run_dir, "model_path=tiny-qwen2-moe", f"steps={steps}", "eval.every=1"),
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and "qwen2_moe L=2 H=64 TP=1 PP=1 DP=2 experts=4 top-2 EP=2" in proc.stdout
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["sync/probe_max_abs_diff"] < 1e-3 and r["train/moe_load_balancing_loss"] > 0.5 for r in records[1:])
    assert {"step_2.dense.json", "step_2.sparse.json"} <= {p.name for p in (run_dir / "eval").glob("*.json")}
    ckpt = run_dir / "checkpoints" / "step_2"
    cli = [sys.executable, "-m", "sparse_rl_megatron.cli", "convert"]
    out = subprocess.run([*cli, "megatron-to-hf", "--input", str(ckpt), "--output", str(tmp_path / "hf")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    back = subprocess.run([*cli, "hf-to-megatron", "--input", str(tmp_path / "hf"), "--output",
                           str(tmp_path / "mcore")], env=env, capture_output=True, text=True, timeout=300)
    assert back.returncode == 0, back.stderr[-2000:]
    again = subprocess.run([*cli, "megatron-to-hf", "--input", str(tmp_path / "mcore"), "--output",
                            str(tmp_path / "hf2")], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    first = load_file(str(tmp_path / "hf" / "model.safetensors"))
    second = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert any(".mlp.shared_expert_gate.weight" in k for k in first) and any(".mlp.experts.3." in k for k in first)
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)
