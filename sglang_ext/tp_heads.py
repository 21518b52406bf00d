"""Tensor parallelism above the KV head count: every replica of a KV head scores with the head's whole query group.

SGLang shards attention heads over the TP ranks (``QKVParallelLinear``): rank r holds the query heads
``[r * Hq / tp, (r + 1) * Hq / tp)`` and, once ``tp > Hkv``, one KV head, ``r // R`` with ``R = tp / Hkv``
replicas per KV head. KV head h's query group (``[h * G, (h + 1) * G)``, ``G = Hq / Hkv``) is then spread over its
R replicas, ``G / R`` heads each, in rank order. The scorers pool attention over a KV head's whole group (GQA
pooling, ``compression/attention.py``); a replica scoring with only its own query heads would keep other tokens
than its sibling replicas and than the unsharded (HF) selection.

So at a compression the replicas exchange their query rings (one all-gather over the attention TP group per
compressing step) and each rebuilds its KV head's whole group, in the unsharded head order.
"""
from __future__ import annotations

from typing import Callable

import torch


class QueryGroups:
    """Rebuilds the whole query group of this rank's KV head from the TP ranks' query rings."""

    def __init__(self, *, tp_rank: int, tp_size: int, total_kv_heads: int,
                 all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``all_gather(x)`` -> ``[tp_size, *x.shape]``, rank order (default: SGLang's attention TP group)."""
        if tp_size > total_kv_heads and tp_size % total_kv_heads:
            raise ValueError(f"tp_size {tp_size} must be a multiple of the KV heads ({total_kv_heads})")
        self.tp_rank, self.tp_size, self.total_kv_heads = tp_rank, tp_size, total_kv_heads
        self._all_gather = all_gather

    @property
    def replicas(self) -> int:
        """R: ranks that hold a copy of each KV head (1 when every rank has whole KV heads of its own)."""
        return max(1, self.tp_size // self.total_kv_heads)

    @property
    def needed(self) -> bool:
        return self.replicas > 1

    def whole_group(self, queries: torch.Tensor) -> torch.Tensor:
        """``queries``: ``[..., Hq_local, alpha, D]`` this rank's ring -> ``[..., G, alpha, D]`` the whole query group
        of its KV head (the same tensor on every replica). A collective: every TP rank calls it together."""
        if not self.needed:
            return queries
        gathered = self._gather(queries.contiguous())                     # [tp, ..., Hq_local, a, D]
        first = (self.tp_rank // self.replicas) * self.replicas
        return torch.cat(list(gathered[first:first + self.replicas]), dim=-3)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        if self._all_gather is not None:
            return self._all_gather(x)
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        group = get_attn_tp_group()
        return group.all_gather(x.unsqueeze(0), dim=0)
