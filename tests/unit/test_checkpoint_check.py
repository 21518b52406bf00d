"""Checkpoints verified before use (``checkpointing/integrity.py``, ``resume.choose``) and a failed save's one line
(``checkpoints.save_failure``), on checkpoint directories laid out as ``checkpoints.save`` writes them (learner
files, per-rank RNG files, then ``trainer_state.json`` with every other file's size). The full path, with a real
learner and a failing writer, runs in ``tests/e2e/test_train_faults.py``."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from sparse_rl_megatron.trainer.checkpointing import checkpoints as C
from sparse_rl_megatron.trainer.checkpointing.integrity import file_sizes, problem
from sparse_rl_megatron.trainer.checkpointing.resume import choose
from sparse_rl_megatron.utils.errors import RunFailed

SHARD = "__0_0.distcp"


def _checkpoint(run_dir: Path, step: int, *, state: bool = True) -> Path:
    out = C.step_dir(run_dir, step)
    (out / "rng").mkdir(parents=True)
    (out / SHARD).write_bytes(bytes(range(256)) * 40)
    (out / ".metadata").write_bytes(b"m" * 300)
    (out / "sparse_rl_checkpoint.json").write_text("{}")
    (out / "rng" / "rank0.pt").write_bytes(b"r" * 50)
    if state:
        record = {"format_version": C.FORMAT_VERSION, "step": step, "weight_version": step, "learner_steps": step,
                  "seed": 0, "data": {}, "world_size": 1, "files": file_sizes(out)}
        (out / C.STATE_FILE).write_text(json.dumps(record))
    return out


def test_an_intact_checkpoint_passes_and_is_resumed(tmp_path):
    for step in (1, 2):
        _checkpoint(tmp_path, step)
    assert problem(C.step_dir(tmp_path, 2), C.FORMAT_VERSION) is None
    choice = choose("auto", tmp_path)
    assert choice.path == C.step_dir(tmp_path, 2) and choice.state.step == 2
    assert choice.notes == [f"resuming from {C.step_dir(tmp_path, 2)}"]
    assert choose("never", tmp_path).path is None


def test_damaged_and_incomplete_checkpoints_are_named_and_the_newest_intact_one_is_resumed(tmp_path):
    for step in (1, 2, 3, 4):
        _checkpoint(tmp_path, step, state=step != 3)
    shard = C.step_dir(tmp_path, 4) / SHARD
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated (a copy cut short, a disk that filled up)
    choice = choose("auto", tmp_path)
    assert choice.path == C.step_dir(tmp_path, 2)
    assert choice.notes == [
        f"checkpoint {C.step_dir(tmp_path, 4)} cannot be used: {SHARD} has 1000 bytes, 10240 were saved (truncated)",
        f"checkpoint {C.step_dir(tmp_path, 3)} cannot be used: it is incomplete (no trainer_state.json: its save was "
        "interrupted, or the file was removed)",
        f"resuming from {C.step_dir(tmp_path, 2)}, the newest intact checkpoint: step 3 to 4 will be redone"]
    (C.step_dir(tmp_path, 2) / "rng" / "rank0.pt").unlink()
    (C.step_dir(tmp_path, 1) / C.STATE_FILE).write_text("{not json")
    with pytest.raises(RunFailed) as err:  # none intact: one line naming each, and how to go on
        choose("auto", tmp_path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"no intact checkpoint in {tmp_path / 'checkpoints'} (step_4: ")
    assert "step_2: rng/rank0.pt is missing; step_1: its trainer_state.json cannot be read (" in message
    assert message.endswith("start over with checkpoint.resume=never (earlier outputs are archived)")


def test_a_run_whose_only_checkpoint_was_interrupted_starts_over_saying_so(tmp_path):
    _checkpoint(tmp_path, 1, state=False)
    choice = choose("auto", tmp_path)
    assert choice.path is None and choice.notes[-1] == "no checkpoint was ever complete: starting from step 0"


def test_an_explicit_damaged_checkpoint_is_refused_in_one_line(tmp_path):
    path = _checkpoint(tmp_path, 5)
    (path / ".metadata").write_bytes(b"m" * 301)
    with pytest.raises(RunFailed, match=r"^checkpoint.resume: .*step_5 cannot be used: \.metadata has 301 bytes, "
                                        r"300 were saved \(it was changed\)$"):
        choose(str(path), tmp_path)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES])
def test_the_disk_error_behind_a_failed_save_is_found(code):
    disk = OSError(code, "simulated")
    try:  # how megatron's writer reports it: a RuntimeError from the OSError, gathered by torch.distributed.checkpoint
        raise RuntimeError("Worker failure") from disk
    except RuntimeError as worker:
        gathered = CheckpointException("write", {0: _wrap_exception(worker)})
    assert C.save_failure(gathered) == (0, str(disk)) and C.save_failure(disk) == (None, str(disk))
    # gathered from another process (pickled): only the text of the OSError is left
    pickled = CheckpointException("write", {2: (RuntimeError(f"Worker failure: {disk}"), None)})
    assert C.save_failure(pickled) == (2, str(disk))
    assert C.save_failure(CheckpointException("write", {})) is None and C.save_failure(ValueError("x")) is None
    assert issubclass(C.SaveFailed, RunFailed) and C.SaveFailed.exit_code == 1


def test_a_killed_writer_behind_a_failed_save_is_found_and_a_bug_is_not():
    from sparse_rl_megatron.learner.save_children import WriterDied

    died = WriterDied("checkpoint writer process 4242 died (signal SIGKILL) before it wrote its files")
    try:  # megatron's saver reads it in the writer's place and wraps it as it wraps a writer's own failure
        raise RuntimeError(f"Worker failure: {died}") from died
    except RuntimeError as worker:
        gathered = CheckpointException("write", {1: _wrap_exception(worker)})
    # the rank it happened on is the key megatron gathered it under
    assert C.save_failure(gathered) == (1, str(died)) and C.save_failure(died) == (None, str(died))
    pickled = CheckpointException("write", {1: (RuntimeError(f"Worker failure: {died}"), None)})  # another rank's
    assert C.save_failure(pickled) == (1, str(died))
    full = CheckpointException("write", {0: (RuntimeError("Worker failure: [Errno 28] No space left on device"), None),
                                         3: (RuntimeError(f"Worker failure: {died}"), None)})
    assert C.save_failure(full) == (0, "[Errno 28] No space left on device")
    assert C.save_failure(OSError(errno.ENOSPC, "No space left on device")) == (None,
                                                                                 "[Errno 28] No space left on device")
    assert C.save_failure(ValueError("a bug")) is None and C.save_failure(CheckpointException("write", {})) is None
