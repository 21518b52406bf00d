"""``sparse-rl train`` of a tiny Qwen2-MoE (its gated shared expert in SGLang's own layer) with ``rollout.engine:
sglang``: an SGLang CPU engine samples compressed rollouts, evaluates dense and sparse, and after every step the
learner's experts reach it by name and the probe checks it serves them (SGLang's dense log-probs of a fixed sequence
vs the learner's, within ``numerics.hf_logprob_tolerance`` of the model). One rank: the experts' export from EP ranks
and several engines are the HF engine's EP 2 runs (tests/e2e/test_train_moe.py) and the dense SGLang run under
torchrun (test_train_sglang.py). A tied-embedding MoE is refused before any model is built."""
from __future__ import annotations

import json

from sglang_helpers import logprob_tolerance
from test_train_sglang import TRAIN, _train

from sparse_rl_megatron.models.tiny import build_tiny_model
from sparse_rl_megatron.trainer.engine_pool.weight_probe import probe_sequence

STEPS = 2
MOE = [a for a in TRAIN if not a.startswith(("model_path=", "steps="))] + ["model_path=tiny-qwen2-moe", f"steps={STEPS}"]


def test_train_a_moe_with_an_sglang_engine(tmp_path, shared_data):
    probe = probe_sequence(512, 32, 0)  # the run's probe: 32 tokens from seed 0 (sync.probe_tokens, seed)
    model = build_tiny_model("qwen2_moe", seed=0, init_std=0.2)  # what model_path=tiny-qwen2-moe builds
    tolerance = logprob_tolerance(model, [probe.prompts[0].tolist()], [probe.responses[0].tolist()])
    run_dir = tmp_path / "run"
    proc = _train(shared_data, f"run_dir={run_dir}", *MOE, f"sync.probe_tolerance={tolerance!r}", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "qwen2_moe L=2 H=64 TP=1 PP=1 DP=1 experts=4 top-2 EP=1 ETP=1" in proc.stdout
    assert "engine 'sglang' serves the learner's weights (version 0)" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1 and "sync/buckets" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["sync/buckets"] >= 1 and r["sync/probe_max_abs_diff"] <= tolerance, (r, tolerance)
        assert r["rollout/compression_events_mean"] > 0 and r["rollout/weight_version"] == r["step"] - 1
        assert 0.5 < r["train/moe_load_balancing_loss"] < 4
    for mode, compressed in (("dense", False), ("sparse", True)):  # evaluated on SGLang after the last step
        record = json.loads((run_dir / "eval" / f"step_{STEPS}.{mode}.json").read_text())
        assert (record["benchmarks"]["gsm8k"]["metrics"]["mean_compression_events"] > 0) == compressed
    assert (run_dir / "checkpoints" / f"step_{STEPS}").is_dir()


def test_a_tied_moe_is_refused_before_any_model_is_built(tmp_path, shared_data):
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

    tied = save_tiny_hf_checkpoint(tmp_path / "tied", "qwen3_moe", seed=1, tie_word_embeddings=True)
    proc = _train(shared_data, f"run_dir={tmp_path / 'run'}", *MOE, f"model_path={tied}", timeout=300)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "rollout.engine=sglang: tie_word_embeddings=true" in lines[0], proc.stderr
    assert not (tmp_path / "run" / "model").exists()
