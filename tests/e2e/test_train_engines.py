"""Several rollout engines under torchrun (issue 18): at DP2, two HF engines (one per rank, each sampling and
scoring its share of the groups) give the samples, metrics, evaluations and weights of one engine serving both
ranks, up to float rounding (a row batched differently may meet other BLAS kernels: issue 29); at PP2 an engine that hangs on rank 1 fails the step on every rank within the phase
timeout with one line naming the engine and its rank, the last checkpoint stays complete, nothing of the run
is left running, and the same command resumes; at TP2 x DP2 (4 ranks) one engine per TP group. The weight-sync
probe is on throughout (TP2 alone: test_train.py, across two torchrun agents)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_train import RECIPE, SMALL, TIMING, _comparable, _env, _flat, _model_state, _records, free_port

PHASE_TIMEOUT_S = 30
EXIT_SLACK_S = 60
"""Time a failing run may take past the phase timeout to report, save nothing new and stop its processes."""
LR = 2e-4  # the recipe's peak learning rate
UPDATES = 3 * 2  # steps x optimizer steps per rollout
# Float rounding between the two runs (the same tokens, log-probs that differ by ~1e-6, see
# tests/unit/test_rollout_engine_shards.py): a metric is a mean of smooth per-token functions of the log-probs
# (ratios e^d, clipping, KL), moved relatively by ~d; METRIC_RTOL leaves two orders of magnitude for the
# weights' differences feeding the next steps. Weights: one Adam update moves a weight by ~lr and its rounding
# by ~lr * 1e-4 at most (the STEP_ATOL reasoning of tests/megatron/workers/mcore_spec.py), so after UPDATES
# updates they agree within UPDATES * lr / 100; a different sample set moves most weights by ~lr per update.
METRIC_RTOL, LOGPROB_ATOL = 1e-3, 1e-4
WEIGHT_ATOL = UPDATES * LR / 100
TASK = ["plugins=[train_task_plugin]", "model_path=task:tiny_sums", "data.dataset=task:tiny_sums", "warm_start={}"]


def _torchrun(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(free_port()), "-m", "sparse_rl_megatron.cli", "train", "--config", RECIPE, f"run_dir={run_dir}",
            *SMALL, *TASK, *overrides]


def _recorded(folder: Path) -> dict[str, list[dict]]:
    """What each rank's engine sampled (the test engine's ``record`` option), by rank file."""
    return {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in sorted(folder.glob("rank*.jsonl"))}


def _eval_results(run_dir: Path) -> dict[str, dict]:
    out = {}
    for path in sorted((run_dir / "eval").glob("*.json")):
        record = json.loads(path.read_text())
        for section in record["benchmarks"].values():
            section.pop("seconds")
        out[path.name] = record
    return out


def _agree(a, b, where: str = "") -> None:
    """``a == b`` up to ``METRIC_RTOL`` on floats (structure, strings, ints and bools exact)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys differ"
        for k in a:
            _agree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _agree(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(b, (str, bool)) and b is not None:
        assert abs(a - b) <= METRIC_RTOL * max(abs(a), abs(b)) + 1e-9, f"{where}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def test_two_engines_at_dp2_sample_and_train_as_one_up_to_rounding(tmp_path, shared_data):
    env = _env(shared_data)
    runs = {}
    for name, per_engine in (("one", 2), ("two", 1)):
        run_dir = tmp_path / name
        cmd = _torchrun(run_dir, "steps=3", "reward.name=parity", "rollout.prompts_per_step=3",
                        "rollout.sampling.max_new_tokens=12", "eval.limit=3", f"rollout.gpus_per_engine={per_engine}",
                        "rollout.engine=flaky", f"rollout.engine_options={{record: {tmp_path / name / 'samples'}}}")
        runs[name] = (run_dir, subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True))
    outputs = {}
    for name, (run_dir, proc) in runs.items():
        outputs[name] = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, outputs[name][-4000:]
    assert "rollout: 1 flaky engine on rank 0 (one per 2 ranks, CPU), 3 groups -> 3 per engine" in outputs["one"]
    assert "rollout: 2 flaky engines on ranks 0-1 (CPU), 3 groups -> 1-2 per engine" in outputs["two"]
    assert "TP=1 PP=1 DP=2" in outputs["two"] and "on all 2 engines: probe mean" in outputs["two"]
    one, two = (tmp_path / "one", tmp_path / "two")

    # the engines sampled the same tokens (and log-probs up to rounding) under the same seeds, each group on one
    # engine; a flip of a token by rounding has probability ~650 tokens x 2e-6 ~ 1e-3 (numerics.flip_probability)
    rec_one, rec_two = _recorded(one / "samples"), _recorded(two / "samples")
    assert list(rec_one) == ["rank0.jsonl"] and list(rec_two) == ["rank0.jsonl", "rank1.jsonl"]
    by_rank = [{(r["call"], r["group"]) for r in rows} for rows in rec_two.values()]
    assert by_rank[0] and by_rank[1] and not by_rank[0] & by_rank[1]
    key = lambda r: (r["call"], r["group"], r["index"])  # noqa: E731
    merged = sorted((r for rows in rec_two.values() for r in rows), key=key)
    alone = sorted(rec_one["rank0.jsonl"], key=key)
    assert len(merged) == len(alone) == 3 * 3 * 2
    for a, b in zip(merged, alone):
        lp_a, lp_b = a.pop("logprobs"), b.pop("logprobs")
        assert a == b and max((abs(x - y) for x, y in zip(lp_a, lp_b)), default=0.0) <= LOGPROB_ATOL, (a, b)

    # ... so every metric but the timings, every evaluation and the trained weights are the same
    rec_a, rec_b = _records(one), _records(two)
    assert [r["step"] for r in rec_a] == [0, 1, 2, 3] == [r["step"] for r in rec_b]
    for a, b in zip(rec_a, rec_b):
        _agree(_comparable(a), _comparable(b), f"step {a['step']}")
    trained = [r for r in rec_a if r["step"] >= 1]
    assert any(r["loss/pg"] != 0 for r in trained) and all(r["sync/probe_max_abs_diff"] < 1e-3 for r in trained)
    assert 0 < sum(r["rollout/reward_mean"] for r in trained) < 3  # parity rewards: a signal in the groups
    _agree(_eval_results(one), _eval_results(two), "eval")
    assert len(_eval_results(one)) == 6  # steps 0, 2, 3 x 2 modes
    w_one, w_two = (dict(_flat(_model_state(run / "checkpoints" / "step_3"))) for run in (one, two))
    assert sorted(w_one) == sorted(w_two)
    for k, v in w_one.items():
        if hasattr(v, "shape") and v.is_floating_point():
            assert (v - w_two[k]).abs().max().item() <= WEIGHT_ATOL, k
        else:
            assert (v == w_two[k]).all() if hasattr(v, "shape") else v == w_two[k], k
    assert all(not k.startswith(TIMING) for k in _comparable(rec_a[-1]))


def test_a_hung_engine_fails_every_rank_within_the_phase_timeout_at_pp2_and_the_rerun_resumes(tmp_path, shared_data):
    """The hang comes while the learner sleeps (``learner.offload: all``: the engines' turn); its last checkpoint,
    written in the learner's turn, is what the rerun resumes from."""
    run_dir = tmp_path / "run"
    cmd = _torchrun(run_dir, "steps=2", "checkpoint.save_every=1", "learner.pipeline_parallel_size=2",
                    f"phase_timeout_s={PHASE_TIMEOUT_S}", "rollout.engine=flaky",
                    "rollout.engine_options={hang_at: 2, fail_rank: 1}", "learner.offload=all")
    proc = subprocess.Popen(cmd, env=_env(shared_data), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        saved = run_dir / "checkpoints" / "step_1" / "trainer_state.json"
        deadline = time.monotonic() + 600
        while not saved.is_file():  # step 1 is complete; step 2's rollout hangs on rank 1
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.1)
        t_saved = time.monotonic()
        out = proc.communicate(timeout=PHASE_TIMEOUT_S + EXIT_SLACK_S)[0]
        failed_after = time.monotonic() - t_saved
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and failed_after < PHASE_TIMEOUT_S + EXIT_SLACK_S
    error = ("EngineError: rollout engine 'flaky' #1 on rank 1 did not finish generating step 2 within 27 s (the phase "
             "timeout, phase_timeout_s, less the margin to report it): the engine hangs")
    assert out.count(error) >= 2, out[-4000:]  # raised on rank 1, and relayed to rank 0
    for rank in (0, 1):
        assert (f"sparse-rl train: failed in the rollout of step 2 on rank {rank}; last complete checkpoint: "
                f"{saved.parent}; rerun the same command to resume") in out
    try:
        os.killpg(proc.pid, 0)
        raise AssertionError("a process of the failed run is still running")
    except ProcessLookupError:
        pass  # nothing of the run is left: torchrun, both ranks and their engines are gone
    assert [r["step"] for r in _records(run_dir)] == [0, 1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]

    rerun = subprocess.run(cmd, env=_env(shared_data), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"resuming from {saved.parent}" in rerun.stdout and "TP=1 PP=2 DP=1" in rerun.stdout
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2] and records[-1]["sync/probe_max_abs_diff"] < 1e-3


def test_tp2_x_dp2_one_engine_per_tensor_parallel_group(tmp_path, shared_data):
    """Four ranks, learner TP2 x DP2, rollout.gpus_per_engine=2: an engine in the first rank of each TP group
    (ranks 0 and 2); ranks 1 and 3 take part in every exchange without an engine of their own. An engine that
    cannot start (rank 2's, first) fails all four ranks with its name."""
    def launch(*extra):
        cmd = _torchrun(tmp_path / "run", "steps=2", "rollout.gpus_per_engine=2", "learner.tensor_parallel_size=2",
                        "rollout.engine=flaky", *extra)
        cmd[cmd.index("--nproc-per-node") + 1] = "4"
        return subprocess.run(cmd, env=_env(shared_data), cwd=tmp_path, capture_output=True, text=True, timeout=600)

    failed = launch("rollout.engine_options={fail_start: 2}")
    error = ("EngineError: rollout engine 'flaky' #1 on rank 2 failed to start: OSError: no GPU memory left for the "
             "engine (simulated)")
    assert failed.returncode != 0 and failed.stderr.count(error) == 4, failed.stderr[-4000:]  # every rank says it
    proc = launch()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rollout: 2 flaky engines on ranks 0,2 (one per 2 ranks, CPU), 2 groups -> 1 per engine" in proc.stdout
    assert "TP=2 PP=1 DP=2" in proc.stdout and "on all 2 engines: probe mean" in proc.stdout
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["sync/probe_max_abs_diff"] < 1e-3 and r["rollout/weight_version"] == r["step"] - 1
               for r in records[1:])
    # the learner asleep between its turns (learner.offload: all) at TP 2 x DP 2: the same run, bit for bit
    cmd = _torchrun(tmp_path / "offload", "steps=2", "rollout.gpus_per_engine=2", "learner.tensor_parallel_size=2",
                    "rollout.engine=flaky", "learner.offload=all")
    cmd[cmd.index("--nproc-per-node") + 1] = "4"
    asleep = subprocess.run(cmd, env=_env(shared_data), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert asleep.returncode == 0, asleep.stdout[-3000:] + asleep.stderr[-3000:]
    assert "TP=2 PP=1 DP=2" in asleep.stdout and "offload=all" in asleep.stdout
    assert [_comparable(r) for r in _records(tmp_path / "offload")] == [_comparable(r) for r in records]
