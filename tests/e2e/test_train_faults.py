"""``sparse-rl train`` meets damaged checkpoints and a full disk (the CPU default in its fast form, one process):
every fault is one line, never a traceback, never a silent restart from step 0.

- a truncated weight shard and a missing ``trainer_state.json`` in the newest checkpoints: both named, the run
  resumes from the newest intact one and redoes the steps after it;
- a checkpoint of another model in the run directory: named when it does not load, the next older one is used;
- no intact checkpoint: the run stops with one line, exit status 1, nothing archived;
- a save that finds the disk full (a writer that gets ENOSPC from the kernel): one line, the previous checkpoint
  intact, exit status 1; the re-run resumes from it;
- a save whose writer processes are killed (SIGKILL, as by the OOM killer): the same, where megatron's saver
  waited for them forever.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import SMALL, _env, _records, _train

from sparse_rl_megatron.trainer.checkpointing.checkpoints import FORMAT_VERSION, STATE_FILE
from sparse_rl_megatron.trainer.checkpointing.integrity import file_sizes, problem

FAST = [*SMALL, "eval.at_start=false", "checkpoint.save_every=1", "checkpoint.keep_last=3"]
TIMEOUT_S = 600


def _run(run_dir: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(_train(run_dir, *FAST[len(SMALL):], *overrides), env=env, cwd=run_dir.parent,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The run failed (exit 1) with exactly one error line and no traceback; returns the line."""
    lines = [x for x in proc.stderr.splitlines() if x.startswith("sparse-rl train: error: ")]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return lines[0]


def _shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.distcp"))[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory, shared_data):
    """A run of 3 steps with a checkpoint after each (``step_1`` .. ``step_3``)."""
    env = _env(shared_data)
    run_dir = tmp_path_factory.mktemp("faults") / "base"
    _ok(_run(run_dir, env, "steps=3"))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3"]
    return run_dir, env


def _copy(base_dir: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(base_dir, run_dir, ignore=shutil.ignore_patterns(".lock"))
    return run_dir


def test_damaged_newest_checkpoints_are_named_and_the_run_resumes_from_the_newest_intact_one(base, tmp_path):
    run_dir = _copy(base[0], tmp_path)
    ckpts = run_dir / "checkpoints"
    shard = _shard(ckpts / "step_3")
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])        # cut short (a copy interrupted, a disk that filled)
    (ckpts / "step_2" / STATE_FILE).unlink()                  # its trainer state gone
    out = _ok(_run(run_dir, base[1], "steps=3"))
    assert (f"checkpoint {ckpts / 'step_3'} cannot be used: {shard.name} has {size // 2} bytes, {size} were saved "
            "(truncated)") in out
    assert f"checkpoint {ckpts / 'step_2'} cannot be used: it is incomplete (no {STATE_FILE}" in out
    assert f"resuming from {ckpts / 'step_1'}, the newest intact checkpoint: step 2 to 3 will be redone" in out
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3]  # steps 2 and 3 redone, each once
    for step in (2, 3):  # and saved again, intact
        assert problem(ckpts / f"step_{step}", FORMAT_VERSION) is None


def test_a_checkpoint_of_another_model_is_named_and_the_next_older_one_is_resumed(base, tmp_path, tiny_model):
    run_dir = _copy(base[0], tmp_path)
    ckpts = run_dir / "checkpoints"
    # the newest checkpoint holds another model (the random tiny Qwen2: hidden 64, not the task's 128), complete
    # and intact on disk: only loading it finds out
    foreign = tmp_path / "foreign"
    convert = subprocess.run([*_train(foreign)[:3], "convert", "hf-to-megatron", "--input", str(tiny_model),
                              "--output", str(foreign)], env=base[1], capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    assert convert.returncode == 0, convert.stderr[-3000:]
    shutil.copytree(foreign, ckpts / "step_4")
    state = json.loads((ckpts / "step_3" / STATE_FILE).read_text())
    state.update(step=4, weight_version=4, files=file_sizes(ckpts / "step_4"))  # a consistent state: only loading finds out
    (ckpts / "step_4" / STATE_FILE).write_text(json.dumps(state))
    out = _ok(_run(run_dir, base[1], "steps=4"))
    assert (f"checkpoint {ckpts / 'step_4'} cannot be used: it does not load into this run's model (ValueError: "
            f"checkpoint {ckpts / 'step_4'} is for another architecture") in out
    assert f"resuming from {ckpts / 'step_3'}, the newest intact checkpoint: step 4 will be redone" in out
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3, 4]


def test_no_intact_checkpoint_stops_the_run_in_one_line(base, tmp_path):
    run_dir = _copy(base[0], tmp_path)
    for ckpt in (run_dir / "checkpoints").iterdir():
        _shard(ckpt).write_bytes(b"")
    line = _one_error_line(_run(run_dir, base[1], "steps=3"))
    assert line.startswith(f"sparse-rl train: error: no intact checkpoint in {run_dir / 'checkpoints'} (step_3: ")
    assert line.endswith("start over with checkpoint.resume=never (earlier outputs are archived)")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3"]
    assert not (run_dir / "archive").exists()  # nothing was moved away


FAILED_SAVES = (("SPARSE_RL_TEST_FULL_DISK_AT_SAVE", r"\[Errno 28\] No space left on device"),
                ("SPARSE_RL_TEST_KILL_WRITER_AT_SAVE", r"checkpoint writer process \d+ died \(signal SIGKILL\) before it "
                                                       r"wrote its files"))
"""Each fault (its fault_plugin switch, the reason the error line gives), injected into the save of step 2: the
fresh run's second learner save, the resumed run's first (fault_plugin counts a process's saves)."""


def test_a_failed_save_stops_the_run_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, shared_data):
    """One run directory takes both faults in turn (the second run resumes from step 1 and fails the same save
    again), then the fault-free re-run resumes from step 1: three runs, not four."""
    import fault_plugin

    run_dir = tmp_path / "run"
    step1, step2 = run_dir / "checkpoints" / "step_1", run_dir / "checkpoints" / "step_2"
    for i, (fault, reason) in enumerate(FAILED_SAVES):
        assert fault in (fault_plugin.FULL_DISK_AT_SAVE, fault_plugin.KILL_WRITER_AT_SAVE)
        proc = _run(run_dir, {**_env(shared_data), fault: "2" if i == 0 else "1"}, "steps=3", "plugins=[fault_plugin]")
        line = _one_error_line(proc)
        assert re.match(rf"sparse-rl train: error: saving checkpoint {re.escape(str(step2))} failed: {reason}; "
                        rf"nothing of it was kept; in the save of step 2 on rank 0; last complete checkpoint: "
                        rf"{re.escape(str(step1))}; rerun the same command to resume", line), (fault, line)
        assert (f"resuming from {step1}" in proc.stdout) == (i > 0), proc.stdout[-2000:]
        assert sorted(p.name for p in step1.parent.iterdir()) == ["step_1"]  # the partial save removed
        assert problem(step1, FORMAT_VERSION) is None
    out = _ok(_run(run_dir, _env(shared_data), "steps=3"))  # the faults gone: the re-run resumes from step 1
    assert f"resuming from {step1}" in out and [r["step"] for r in _records(run_dir)] == [1, 2, 3]


def test_an_engine_that_fails_the_probe_at_start_up_stops_the_run_in_one_line(tmp_path, shared_data):
    # the tiny model (fp32 learner and engine: ~1e-7 apart) under a tolerance nothing meets: the start-up probe
    # fails before any step, as a wrong or garbled engine would, in one line naming the engine and its rank
    run_dir, recipe = tmp_path / "probe", tmp_path / "tiny.yaml"
    recipe.write_text("model_path: tiny\nsteps: 1\ndata: {dataset: gsm8k_train}\nlog: {progress: false}\n"
                      "rollout: {prompts_per_step: 1, samples_per_prompt: 2, sampling: {max_new_tokens: 4}}\n")
    cmd = [sys.executable, "-m", "sparse_rl_megatron.cli", "train", "--config", str(recipe), f"run_dir={run_dir}",
           "eval.at_start=false", "sync.probe_tolerance=1e-12"]
    proc = subprocess.run(cmd, env=_env(shared_data), cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    line = _one_error_line(proc)
    assert line.startswith("sparse-rl train: error: rollout engine 'hf' #0 on rank 0 does not serve the learner's "
                           "weights (version 0): its dense log-probs of the probe sequence differ from the "
                           "learner's by "), line
    assert line.endswith("> sync.probe_tolerance 1e-12: garbled or wrong weights"), line
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
