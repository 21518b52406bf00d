"""Save faults for ``sparse-rl train`` fault tests (``plugins=[fault_plugin]`` with this folder on PYTHONPATH):
- a disk that fills up: from the ``SPARSE_RL_TEST_FULL_DISK_AT_SAVE``-th learner save on, megatron's file writers
  write the checkpoint's shards to ``/dev/full``, so the kernel answers ENOSPC ("No space left on device")
  exactly as a full disk does, and megatron's own error path (writer process -> gathered results -> every rank)
  reports it;
- a writer that is killed: in the ``SPARSE_RL_TEST_KILL_WRITER_AT_SAVE``-th learner save, each of megatron's
  writer processes sends itself SIGKILL before it writes (as the OOM killer would kill it); with
  ``SPARSE_RL_TEST_KILL_WRITER_RANK`` set, on that rank only."""
from __future__ import annotations

import os
import signal

FULL_DISK_AT_SAVE = "SPARSE_RL_TEST_FULL_DISK_AT_SAVE"
KILL_WRITER_AT_SAVE = "SPARSE_RL_TEST_KILL_WRITER_AT_SAVE"
KILL_WRITER_RANK = "SPARSE_RL_TEST_KILL_WRITER_RANK"


def _fill_the_disk() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    real = FileSystemWriterAsync.write_preloaded_data

    def to_a_full_disk(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
        _, storage_key, data = write_bucket
        return real(transform_list, local_proc_idx, ("/dev/full", storage_key, data), *args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(to_a_full_disk)


def _kill_the_writers():
    """Until the returned undo is called, each writer process megatron starts kills itself first."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    real = FileSystemWriterAsync.write_preloaded_data

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(killed)
    return lambda: setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(real))


def _at_save(number: int, fault) -> None:
    """Call ``fault()`` before the ``number``-th learner save; the undo it returns, if any, after that save."""
    from sparse_rl_megatron.learner.learner import Learner

    real_save, saves = Learner.save, [0]

    def save(self, ckpt_dir):
        saves[0] += 1
        undo = fault() if saves[0] == number else None
        try:
            return real_save(self, ckpt_dir)
        finally:
            if undo is not None:
                undo()

    Learner.save = save


if os.environ.get(FULL_DISK_AT_SAVE):
    _at_save(int(os.environ[FULL_DISK_AT_SAVE]), _fill_the_disk)
if os.environ.get(KILL_WRITER_AT_SAVE) and os.environ.get(KILL_WRITER_RANK, os.environ.get("RANK", "0")) == \
        os.environ.get("RANK", "0"):
    _at_save(int(os.environ[KILL_WRITER_AT_SAVE]), _kill_the_writers)
