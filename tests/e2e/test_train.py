"""``sparse-rl train`` end to end on CPU: the embedded default in a fast form, stop + resume with the learner put to
sleep between its turns (``learner.offload: all``) equal to an uninterrupted run that keeps it awake, interrupted checkpoints ignored, the run-directory lock, and two torchrun agents (two "nodes"
on a localhost c10d rendezvous, TP = 2 across them, one engine each) training a task model with KL on until one
node's engine dies, then resuming."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RECIPE = str(ROOT / "configs" / "cpu_default.yaml")
# The CPU default (task:modchain31_wordbox_weak, R-KV B = 8), smaller: a 4-step warm start (unchecked: it would miss the
# task's warm-start check, tests/unit/test_task_warm_check.py), 2 prompts x 2 samples of 16 tokens (B = 8 as the
# default's, so that they compress: B + W = 12 < 16), 2 optimizer steps per rollout, tiny evals.
SMALL = ["warm_start={steps: 4, eval_problems: 0}", "warm_check.enabled=false", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
         "global_batch_size=2", "rollout.sampling.max_new_tokens=16", "rollout.compression.budget=8", "eval.limit=2",
         "eval.max_new_tokens=8", "eval.every=2", "log.progress=false", "log.plot=false"]
# (the PNG plot, ~2 CPU s at the end of each run, is drawn by the uninterrupted run of the stop-and-resume test)
# Metrics that measure time differ between two identical runs; everything else must not.
TIMING = ("time", "time/", "throughput/", "train/step_time_s", "train/tokens_per_s", "sync/seconds")
OFFLOAD = "learner.offload=all"  # weights, gradients and Adam state off the device between the learner's turns


def _env(shared_data: Path) -> dict:
    return {**os.environ, "SPARSE_RL_DATA": str(shared_data), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), "PYTHONWARNINGS": "ignore"}


def _train(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "sparse_rl_megatron.cli", "train", "--config", RECIPE, f"run_dir={run_dir}", *SMALL,
            *overrides]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def _model_state(ckpt: Path) -> dict:
    """The tensors of a torch_dist checkpoint, read without megatron-core."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}/")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}/")
    else:
        yield prefix, tree


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stale_lock(run_dir: Path) -> int:
    """Leave the lock record of a run that died without cleaning up (SIGKILL); returns its pid."""
    hold = ("import sys, time; from sparse_rl_megatron.trainer.runtime.run_dir import RunDirLock; "
            "RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", hold, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    proc.kill()
    proc.wait()
    return proc.pid


def test_stop_and_resume_equals_the_uninterrupted_run(tmp_path, shared_data):
    env = _env(shared_data)
    whole, split = tmp_path / "whole", tmp_path / "split"
    dead_pid = _stale_lock(whole)
    # the uninterrupted run (the embedded default, fast form) and the first half of the split one, side by side
    a = subprocess.Popen(_train(whole, "steps=4", "log.plot=true"), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    # the split run's learner sleeps while the engine rolls out and evaluates: bit-identical to one that does not
    b = subprocess.Popen(_train(split, "steps=4", OFFLOAD), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400
    while not ((split / "metrics.jsonl").is_file() and any(r["step"] >= 1 for r in _records(split))):
        assert b.poll() is None and time.monotonic() < deadline, b.communicate()[1][-3000:]
        time.sleep(0.1)
    b.send_signal(signal.SIGTERM)  # stops at the end of the current step, after a checkpoint
    out, err = b.communicate(timeout=300)
    assert b.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "SIGTERM received: stopping at the end of the current step" in err
    stopped = [line for line in out.splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 1 and "by SIGTERM; checkpoint" in stopped[0], out[-2000:]
    k = int(stopped[0].split()[3])
    assert 1 <= k < 4
    ckpts = split / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{k}"]
    # a later save killed half-way: the learner's files without the trainer state, and the learner's staging dir
    shutil.copytree(ckpts / f"step_{k}", ckpts / f"step_{k + 1}", ignore=shutil.ignore_patterns("trainer_state.json"))
    (ckpts / f"step_{k + 1}.saving").mkdir()

    resumed = subprocess.run(_train(split, "steps=4", OFFLOAD), env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {ckpts / f'step_{k}'}" in resumed.stdout
    out, err = a.communicate(timeout=600)
    assert a.returncode == 0, err[-3000:]
    assert f"took over the lock of a run that is no longer alive (pid {dead_pid} " in out

    # same steps, each once, with the same numbers (bit-exact on CPU, one thread)
    whole_records, split_records = _records(whole), _records(split)
    assert [r["step"] for r in whole_records] == [0, 1, 2, 3, 4] == [r["step"] for r in split_records]
    for w, s in zip(whole_records, split_records):
        assert _comparable(w) == _comparable(s), f"step {w['step']} differs"
    # same weights and optimizer state at the end
    w_state, s_state = dict(_flat(_model_state(whole / "checkpoints" / "step_4"))), dict(
        _flat(_model_state(ckpts / "step_4")))
    assert sorted(w_state) == sorted(s_state) and any("optimizer" in key for key in w_state)
    for key, value in w_state.items():
        assert (value == s_state[key]).all() if hasattr(value, "shape") else value == s_state[key], key
    # interrupted checkpoints older than the newest complete one are gone; the last two complete ones stay
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == sorted({f"step_{k}", "step_4"} | (
        {f"step_{k + 1}"} if k + 1 == 4 else set()))

    # what the embedded default writes: metrics with a finite loss, evaluations dense and sparse, plot, TensorBoard
    last = whole_records[-1]
    assert math.isfinite(last["loss/pg"]) and last["train/optimizer_steps"] == 2 and last["train/step"] == 8
    assert last["rollout/compression_events_mean"] > 0 and last["sync/probe_max_abs_diff"] < 1e-3
    assert {"eval/dense/accuracy", "eval/sparse/accuracy"} <= set(whole_records[0]) & set(last)
    assert (whole / "eval" / "step_4.sparse.json").is_file() and (whole / "metrics.png").stat().st_size > 0
    assert any((whole / "tensorboard").iterdir()) and (whole / "config.yaml").is_file()
    assert json.loads((whole / "checkpoints" / "step_4" / "trainer_state.json").read_text())["data"]["consumed"] == 8


def test_a_stop_during_the_warm_start_ends_the_run_there_and_a_rerun_builds_it(tmp_path, shared_data):
    """SIGTERM while the task's (checked) warm start trains: the run stops before the next supervised step, not after
    the whole stage (minutes, three attempts when checked), in one line, exit 0; the built model is kept, nothing of
    the interrupted warm start is, and a re-run warm-starts from the kept model and trains."""
    run_dir = tmp_path / "run"
    long_warm = ["warm_start.steps=100000", "warm_start.log_every=1", "warm_check.enabled=true", "steps=1"]
    proc = subprocess.Popen(_train(run_dir, *long_warm), env=_env(shared_data), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the supervised stage has begun
        if line.startswith("sft step 1/100000"):
            break
    else:
        pytest.fail(f"no supervised step: {proc.communicate()[1][-3000:]}")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("sparse-rl train: stopped by SIGTERM during the supervised warm start, before step "), out
    assert last.endswith("of 100000; nothing of it was kept: a re-run builds it again")
    assert int(last.split("before step ")[1].split()[0]) < 1000  # long before the stage's end
    model = run_dir / "model"
    assert (model / "init" / "config.json").is_file() and not (model / "warm").exists()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    again = subprocess.run(_train(run_dir), env=_env(shared_data), cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"warm-started it into {model / 'warm'}" in again.stdout and (model / "warm" / "config.json").is_file()
    assert "built the" not in again.stdout  # the kept model, not a new one


def test_second_run_into_a_busy_run_dir_is_refused_with_the_holders_pid(tmp_path, shared_data):
    hold = ("import sys, time; from sparse_rl_megatron.trainer.runtime.run_dir import RunDirLock; "
            "RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        out = subprocess.run(_train(tmp_path / "run"), env=_env(shared_data), cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"sparse-rl train: error: run directory {tmp_path / 'run'} is in use by pid {holder.pid} on " in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _agents(args: list[str], env: dict, cwd: Path) -> tuple[list[int], list[str]]:
    """Two torchrun agents (two "nodes", one rank each) running launch/torchrun.sh with ``args``."""
    agents = [subprocess.Popen(["bash", str(ROOT / "launch" / "torchrun.sh"), *args], env=env, cwd=cwd,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    return [agent.returncode for agent in agents], outputs


def test_two_torchrun_agents_each_serve_their_share_at_tp2_fail_together_and_resume(tmp_path, shared_data):
    env = {**_env(shared_data), "NNODES": "2", "NPROC_PER_NODE": "1", "RDZV_ID": f"test-{os.getpid()}",
           "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "PYTHON": sys.executable}
    run_dir = tmp_path / "run"
    # two "nodes", one rank each, the learner TP2 across them; every node's rank drives its own engine (one per
    # rank) and scores its share of the groups. Two steps train; rank 1's engine dies in its third rollout. A random
    # model's rewards are mostly all 0 (advantage 0): weight decay moves the policy anyway, so the KL to the reference
    # is measurable after the first step.
    args = ["--config", RECIPE, f"run_dir={run_dir}", *SMALL, "steps=4", "checkpoint.save_every=1",
            "plugins=[train_task_plugin]", "model_path=task:tiny_sums", "data.dataset=task:tiny_sums",
            "eval.datasets=[]", "warm_start={lr: 0.5}", "rollout.compression.budget=12",
            "rollout.compression.scope=all",
            "learner.tensor_parallel_size=2", "learner.loss.kl_coef=0.001", "learner.optim.weight_decay=0.1",
            "learner.optim.lr_warmup_steps=0",  # the default warms up from lr 0: the first step would not move
            "rollout.engine=flaky", "rollout.engine_options={fail_at: 3, fail_rank: 1}"]
    codes, outputs = _agents(args, env, tmp_path)
    layout = "rollout: 2 flaky engines on ranks 0-1 (CPU), 2 groups -> 1 per engine"
    for output in outputs:
        assert "[preflight]" in output and "TP 2 x PP 1 x DP 1 = 2 ranks" in output, output[-4000:]
        assert layout in output.split("[preflight]", 1)[1].splitlines()[0]  # preflight says what starts
    text = "\n".join(outputs)
    assert "TP=2 PP=1 DP=1" in text and "world 2" in text and "[heartbeat]" in text and f"\n{layout}\n" in text
    assert "serves the learner's weights (version 0) on all 2 engines" in text
    # the task's model was built and warm-started with the recipe's options
    assert json.loads((run_dir / "model" / "warm" / "warm_options.json").read_text()) == {"lr": 0.5}
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2], text[-4000:]
    for r in records[1:]:
        assert math.isfinite(r["loss/pg"]) and r["loss/kl"] > 0 and r["time/ref_s"] > 0
        assert r["sync/probe_max_abs_diff"] < 1e-3 and r["train/optimizer_steps"] == 2
    step2 = run_dir / "checkpoints" / "step_2"
    assert (step2 / "trainer_state.json").is_file()
    assert sorted(p.name for p in (step2 / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    # rank 1's engine dies: both ranks fail (rank 0 is told instead of waiting for samples that never come), each
    # with the one line naming the engine, its rank and the step, and where to resume from
    assert codes == [1, 1] or all(c != 0 for c in codes), codes
    error = ("EngineError: rollout engine 'flaky' #1 on rank 1 failed while generating step 3: ConnectionError: "
             "engine process is gone (simulated)")
    assert all(error in output for output in outputs), text[-4000:]
    for rank in (0, 1):
        assert (f"sparse-rl train: failed in the rollout of step 3 on rank {rank}; last complete checkpoint: "
                f"{step2}; rerun the same command to resume") in text

    # the same command again: resumes from step 2 on both nodes and finishes
    codes, outputs = _agents(args, {**env, "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}, tmp_path)
    text = "\n".join(outputs)
    assert codes == [0, 0], text[-4000:]
    assert f"resuming from {step2}" in text
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[-1]["rollout/weight_version"] == 3 and records[-1]["sync/probe_max_abs_diff"] < 1e-3
    assert (run_dir / "checkpoints" / "step_4" / "trainer_state.json").is_file()
