"""A disk that fills up, for ``sparse-rl train`` fault tests (``plugins=[fault_plugin]`` with this folder on
PYTHONPATH): from the ``SPARSE_RL_TEST_FULL_DISK_AT_SAVE``-th learner save on, megatron's file writers write the
checkpoint's shards to ``/dev/full``, so the kernel answers ENOSPC ("No space left on device") exactly as a full
disk does, and megatron's own error path (writer process -> gathered results -> every rank) reports it."""
from __future__ import annotations

import os

FULL_DISK_AT_SAVE = "SPARSE_RL_TEST_FULL_DISK_AT_SAVE"


def _fill_the_disk() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    real = FileSystemWriterAsync.write_preloaded_data

    def to_a_full_disk(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
        _, storage_key, data = write_bucket
        return real(transform_list, local_proc_idx, ("/dev/full", storage_key, data), *args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(to_a_full_disk)


if os.environ.get(FULL_DISK_AT_SAVE):
    from sparse_rl_megatron.learner.learner import Learner

    _at, _real_save, _saves = int(os.environ[FULL_DISK_AT_SAVE]), Learner.save, [0]

    def _save(self, ckpt_dir):
        _saves[0] += 1
        if _saves[0] == _at:
            _fill_the_disk()
        return _real_save(self, ckpt_dir)

    Learner.save = _save
