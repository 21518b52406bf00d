"""What the inner attention backend is built on, and the model-runner facts the ``sparse_kv`` backend reads.

The inner backend (``torch_native``, ``triton``, ``flashinfer``, ``fa3``) takes everything from the model runner
it is built with. It gets a :class:`RunnerView`: the real runner, except the request-to-token table (the plugin's
physical table) and the ``KVIndexTranslator`` (one over that table), which SGLang's triton and flashinfer
backends build their kernel index lists through.
"""
from __future__ import annotations

from typing import Any

import torch

from sglang_ext.config import BACKEND_NAME, ConfigError
from sglang_ext.tp_heads import QueryGroups


class PoolView:
    """``req_to_token_pool`` as the inner backend sees it: the physical table instead of the logical one."""

    def __init__(self, pool, table: torch.Tensor):
        self._pool = pool
        self.req_to_token = table

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class RunnerView:
    """The model runner as the inner backend sees it: the token table, and the index translator every GPU
    backend builds its kernel index lists through (triton's ``pack_read_stream``, flashinfer's
    ``call_begin_forward``), are the plugin's; everything else is the real runner's."""

    def __init__(self, runner, table: torch.Tensor, translator):
        self._runner = runner
        self.req_to_token_pool = PoolView(runner.req_to_token_pool, table)
        self.kv_index_translator = translator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def physical_translator(model_runner, table: torch.Tensor):
    """A ``KVIndexTranslator`` over the plugin's physical table (SGLang's own one reads ``req_to_token``, the
    logical rows, which after a compression hold evicted zeros and miss the newest tokens).

    Only a pass-through translator can be rebuilt over another table: a pool whose ids are virtual (unified
    memory, a fused draft pool) or decode context parallelism translates the ids it reads, which the
    plugin's slots would bypass; those are refused here (and at start, by flag, in ``refusals``)."""
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

    real = getattr(model_runner, "kv_index_translator", None)
    if real is not None and (real.is_translating or real.needs_read_translate):
        pool = type(model_runner.token_to_kv_pool).__name__
        raise ConfigError(f"{BACKEND_NAME}: the KV pool translates its ids ({pool}: unified memory or decode context "
                          f"parallelism); {BACKEND_NAME} needs a plain pool")
    translator = KVIndexTranslator(
        req_to_token=table, token_to_kv_pool_allocator=model_runner.token_to_kv_pool_allocator,
        token_to_kv_pool=model_runner.token_to_kv_pool, page_size=getattr(model_runner, "page_size", 1) or 1,
        device=model_runner.device, is_draft_worker=bool(getattr(model_runner, "is_draft_worker", False)))
    if translator.is_translating:
        raise ConfigError(f"{BACKEND_NAME}: the KV index translator over the plugin's table is not a pass-through")
    return translator


def kv_cache_region(model_runner):
    """SGLang's KV-cache memory-saver region (released and restored with the KV cache; a no-op without it)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    enabled = bool(getattr(model_runner.server_args, "enable_memory_saver", False))
    return TorchMemorySaverAdapter.create(enable=enabled).region(GPU_MEMORY_TYPE_KV_CACHE)


def tp_rank(model_runner) -> int:
    tp = int(getattr(model_runner.server_args, "tp_size", 1) or 1)
    if tp == 1:
        return 0
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().attn_tp_rank)


def query_groups(model_config, tp: int) -> QueryGroups:
    """Who holds the rest of this rank's KV-head query group when TP exceeds the KV heads (``tp_heads``)."""
    total_kv = int(model_config.get_total_num_kv_heads())
    rank = 0
    if tp > total_kv:
        from sglang.srt.runtime_context import get_parallel

        rank = int(get_parallel().attn_tp_rank)
    return QueryGroups(tp_rank=rank, tp_size=tp, total_kv_heads=total_kv)
