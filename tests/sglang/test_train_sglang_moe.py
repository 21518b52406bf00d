"""``sparse-rl train`` of a tiny Qwen3-MoE with ``rollout.engine: sglang`` under torchrun, 2 ranks at EP 2 (DP 2): two
SGLang CPU engines, one per rank, sample compressed rollouts of their share of the groups; after every step the
learner's experts (each held by one EP rank, gathered by the export) reach both engines, and the probe checks each
engine serves them (SGLang's dense log-probs of a fixed sequence vs the learner's, within
``numerics.hf_logprob_tolerance`` of the model). A tied-embedding MoE is refused before any model is built."""
from __future__ import annotations

import json

from sglang_helpers import logprob_tolerance
from test_train_sglang import TRAIN, _train

from sparse_rl_megatron.models.tiny import build_tiny_model
from sparse_rl_megatron.trainer.engines.weight_probe import probe_sequence

STEPS = 2
MOE = [a for a in TRAIN if not a.startswith(("model_path=", "steps=", "eval."))] + [
    "model_path=tiny-qwen3-moe", f"steps={STEPS}", "learner.expert_parallel_size=2", "eval.datasets=[]"]


def test_train_a_moe_at_ep2_with_two_sglang_engines(tmp_path, shared_data):
    probe = probe_sequence(512, 32, 0)  # the run's probe: 32 tokens from seed 0 (sync.probe_tokens, seed)
    model = build_tiny_model("qwen3_moe", seed=0, init_std=0.2)  # what model_path=tiny-qwen3-moe builds
    tolerance = logprob_tolerance(model, [probe.prompts[0].tolist()], [probe.responses[0].tolist()])
    run_dir = tmp_path / "run"
    proc = _train(shared_data, f"run_dir={run_dir}", *MOE, f"sync.probe_tolerance={tolerance!r}", timeout=900,
                  ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "rollout: 2 sglang engines x TP1 on ranks 0-1 (CPU), 2 groups -> 1 per engine" in proc.stdout
    assert "TP=1 PP=1 DP=2 experts=4 top-2 EP=2 ETP=1" in proc.stdout
    assert "engine 'sglang' serves the learner's weights (version 0) on all 2 engines" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["sync/buckets"] >= 1 and r["sync/probe_max_abs_diff"] <= tolerance, (r, tolerance)
        assert r["rollout/compression_events_mean"] > 0 and r["rollout/weight_version"] == r["step"] - 1
        assert 0.5 < r["train/moe_load_balancing_loss"] < 4
    assert (run_dir / "checkpoints" / f"step_{STEPS}").is_dir()


def test_a_tied_moe_is_refused_before_any_model_is_built(tmp_path, shared_data):
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

    tied = save_tiny_hf_checkpoint(tmp_path / "tied", "qwen3_moe", seed=1, tie_word_embeddings=True)
    proc = _train(shared_data, f"run_dir={tmp_path / 'run'}", *MOE, f"model_path={tied}", "learner.expert_parallel_size=1",
                  timeout=300)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "rollout.engine=sglang: tie_word_embeddings=true" in lines[0], proc.stderr
    assert not (tmp_path / "run" / "model").exists()
