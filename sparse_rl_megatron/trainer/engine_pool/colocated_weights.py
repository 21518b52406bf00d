"""Weights into a colocated in-process engine that spans several GPUs: each of its TP ranks gets every bucket
from the learner rank on its own GPU.

The learner's export gives every rank every bucket (on its own device). For an engine on GPUs ``b .. b+T-1``,
learner rank ``first + r`` (local rank ``b + r``) serializes its copy (``sglang_weights.serialize_bucket``: on
CUDA an IPC handle, never a host copy) and the engine's first rank gathers the T payloads, in TP-rank order, over
a gloo group of the engine's ranks; the engine's TP rank r opens payload r, i.e. memory already on its GPU. The
members keep their copy until the engine has loaded the bucket (a barrier after the driver's push), then drop it
(``torch.cuda.ipc_collect`` releases the handles). One bucket is alive at a time on every GPU.

An engine on one GPU needs no group: its rank serializes its own copy.
"""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch

from sparse_rl_megatron.utils.device import cuda_present

if TYPE_CHECKING:
    from sparse_rl_megatron.rollout.layout import RolloutLayout


class ColocatedPayloads:
    """This rank's part in serializing buckets for its colocated engine (see the module docstring)."""

    def __init__(self, layout: "RolloutLayout", rank: int, timeout_s: float, serialize=None):
        """Collective when an engine spans several ranks (every rank creates every engine's group)."""
        import torch.distributed as dist

        if serialize is None:
            from sparse_rl_megatron.rollout.sglang_weights import serialize_bucket as serialize
        self.serialize = serialize
        self.group = None
        self.members: tuple[int, ...] = (rank,)
        self.driver = rank
        self.rank = rank
        for slot in layout.slots:
            if len(slot.ranks) > 1:  # dist.new_group is collective over the whole world, member or not
                group = dist.new_group(list(slot.ranks), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
                if rank in slot.ranks:
                    self.group, self.members, self.driver = group, slot.ranks, slot.rank

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver

    def gather(self, bucket) -> list | None:
        """Every member: serialize this rank's copy of ``bucket``; the driver gets every TP rank's payload."""
        import torch.distributed as dist

        payload = self.serialize(bucket)
        if self.group is None:
            return [payload]
        out = [None] * len(self.members) if self.is_driver else None
        dist.gather_object(payload, out, dst=self.driver, group=self.group)
        return out

    def release(self) -> None:
        """After the driver's push of the bucket: the members may drop their copies."""
        import torch.distributed as dist

        if self.group is not None:
            dist.barrier(group=self.group)
        if cuda_present():
            torch.cuda.ipc_collect()
