"""``sparse-rl train`` with ``rollout.engine: sglang`` under torchrun with 2 ranks (learner DP2): two SGLang CPU
engines, one in each rank's process (strict idle and busy memory checks on), each sample compressed rollouts of
its share of the groups for the Megatron learner, take its weights after every step and serve them exactly (the
post-sync probe on each engine: SGLang's dense log-probs of a fixed sequence vs the learner's within
``numerics.hf_logprob_tolerance``), and evaluate their share of the held-out problems dense and sparse. The same
run has the adaptive KV budget on (issue 27): both servers are sized for max_budget and every step's requests, on
both engines, carry that step's budget, which follows the controller. One start per engine for the whole run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sglang_helpers import STRICT_MEMORY_CHECKS, logprob_tolerance

from sparse_rl_megatron.trainer.engine_pool.weight_probe import probe_sequence
from sparse_rl_megatron.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _probe_tolerance() -> float:
    """The probe's log-probs, SGLang vs the learner, within ``numerics.hf_logprob_tolerance`` of the run's model
    (``model_path=tiny``: the tiny Qwen2 of seed 0, init_std 0.2) over the run's probe sequence (32 tokens drawn
    from seed 0). Two steps at lr 1e-6 move the weights, and so the measured scales, by a negligible fraction."""
    probe = probe_sequence(512, 32, 0)
    model = build_tiny_model(seed=0, init_std=0.2)
    return logprob_tolerance(model, [probe.prompts[0].tolist()], [probe.responses[0].tolist()])


STEPS = 3
# A tiny random Qwen2 (built by the run), GSM8K prompts, 2 prompts x 2 samples, R-KV at B=12, alpha=2, W=4: every
# rollout compresses (the chat prompt alone is longer than B + W); eval before the first and after the last step.
TRAIN = ["model_path=tiny", f"steps={STEPS}", "data.dataset=gsm8k_train", "data.limit=8", "global_batch_size=2",
         "rollout.engine=sglang", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
         "rollout.sampling.max_new_tokens=16", "rollout.compression.method=rkv", "rollout.compression.budget=12",
         "rollout.compression.window=2", "rollout.compression.buffer=4", "rollout.compression.scope=all",
         "rollout.sglang.max_total_tokens=4096",
         "eval.datasets=[gsm8k]", "eval.limit=2", "eval.max_new_tokens=8",
         "log.progress=false", "log.tensorboard=false", "log.plot=false"]


def _env(shared_data: Path) -> dict:
    return {**os.environ, **STRICT_MEMORY_CHECKS, "SPARSE_RL_DATA": str(shared_data), "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}


def _train(shared_data: Path, *args: str, timeout: int, ranks: int = 1) -> subprocess.CompletedProcess:
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                                      "--master-port", str(_free_port())]
    return subprocess.run([sys.executable, *launcher, "-m", "sparse_rl_megatron.cli", "train", *args],
                          env=_env(shared_data), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ADAPTIVE = dict(target=0.3, min_budget=4, max_budget=16, gain=2.0, deadband=0.0, granule=1)
"""The adaptive budget's settings: a target the tiny model's contamination share misses, so the budget moves."""


def test_train_with_two_sglang_engines_under_torchrun_and_the_adaptive_budget(tmp_path, shared_data):
    from sparse_rl_megatron.compression.budget_controller import AdaptiveBudgetConfig, BudgetController

    run_dir = tmp_path / "run"
    tolerance = _probe_tolerance()
    adaptive = "rollout.adaptive_budget={enabled: true, " + ", ".join(f"{k}: {v}" for k, v in ADAPTIVE.items()) + "}"
    proc = _train(shared_data, f"run_dir={run_dir}", *TRAIN, f"sync.probe_tolerance={tolerance!r}", adaptive,
                  timeout=900, ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "rollout: 2 sglang engines x TP1 on ranks 0-1 (CPU), 2 groups -> 1 per engine" in proc.stdout
    assert "TP=1 PP=1 DP=2" in proc.stdout
    assert "engine 'sglang' serves the learner's weights (version 0) on all 2 engines" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1 and "sync/buckets" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:  # synced every step, and SGLang then served exactly the learner's weights
        assert r["sync/buckets"] >= 1 and r["sync/mib"] > 0
        assert r["sync/probe_max_abs_diff"] <= tolerance, (r, tolerance)
        print(f"probe: max |delta| {r['sync/probe_max_abs_diff']:.3g} <= bound {tolerance:.3g}")
    for r in steps:  # compressed rollouts, sampled with the weights of the previous step's sync
        assert r["rollout/compression_events_mean"] > 0 and r["rollout/kv_retained_frac"] < 1, r
        assert r["rollout/weight_version"] == r["step"] - 1
    # before/after evaluation of the live policy on SGLang, dense and sparse
    for step in (0, STEPS):
        row = next(r for r in records if r["step"] == step and "eval/dense/accuracy" in r)
        assert 0.0 <= row["eval/dense/accuracy"] <= 1.0 and 0.0 <= row["eval/sparse/accuracy"] <= 1.0
        for mode, compressed in (("dense", False), ("sparse", True)):
            record = json.loads((run_dir / "eval" / f"step_{step}.{mode}.json").read_text())
            assert (record["benchmarks"]["gsm8k"]["metrics"]["mean_compression_events"] > 0) == compressed
    assert (run_dir / "checkpoints" / f"step_{STEPS}").is_dir()
    # the adaptive budget: the first step at the stated budget (12), each step's budget the controller's answer to
    # the signal logged before, and what both engines sampled with
    assert steps[0]["rollout/budget"] == 12
    replay = BudgetController(AdaptiveBudgetConfig(**ADAPTIVE), 12)
    for r in steps:
        assert r["rollout/budget"] == replay.budget == r["rollout/budget_sampled_mean"], r
        replay.update(r["rollout/budget_signal"])
    assert len({r["rollout/budget"] for r in steps}) > 1, [r["rollout/budget"] for r in steps]


PARTIAL = ["rollout.partial.enabled=true", "rollout.partial.segment_tokens=6", "rollout.partial.extra_groups=2",
           "rollout.partial.max_staleness=2"]
"""Partial rollouts: 16-token responses in calls of 6, two groups beyond the step's two in flight."""


def test_partial_rollouts_on_two_sglang_engines_under_torchrun(tmp_path, shared_data):
    # every engine call continues the responses carried on that engine's share; the weights change between calls
    # of one response, and the probe still finds each engine serving the learner's weights after every sync
    run_dir = tmp_path / "run"
    tolerance = _probe_tolerance()
    proc = _train(shared_data, f"run_dir={run_dir}", *TRAIN, *PARTIAL, f"sync.probe_tolerance={tolerance!r}",
                  timeout=900, ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "rollout: 2 sglang engines x TP1 on ranks 0-1 (CPU)" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1 and "sync/buckets" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["sync/probe_max_abs_diff"] <= tolerance, (r, tolerance)
        assert r["rollout/partial/segments"] >= (3 if r["step"] == 1 else 1)  # 16 tokens in calls of 6; then carried
        assert r["rollout/compression_events_mean"] > 0
        assert r["rollout/partial/staleness_max"] <= 2
    assert max(r["rollout/partial/carried_requests"] for r in steps) > 0
    assert max(r["rollout/partial/staleness_max"] for r in steps) >= 1   # tokens of an older version trained
    assert max(r["rollout/partial/continued_frac"] for r in steps) > 0
    assert any("sparse/partial/abs_log_rho_lagged_mean" in r for r in steps)
    state = json.loads((run_dir / "checkpoints" / f"step_{STEPS}" / "trainer_state.json").read_text())
    assert state["partial"]["in_flight"], "the last checkpoint holds no sample in flight"


def test_bad_sglang_option_is_one_line_at_start(tmp_path, shared_data):
    proc = _train(shared_data, f"run_dir={tmp_path / 'run'}", *TRAIN, "rollout.sglang.weight_sync=nccl", timeout=300)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "rollout.sglang" in lines[0] and "tensor, distributed, disk" in lines[0], proc.stderr
    assert not (tmp_path / "run" / "model").exists()  # refused before any model was built

