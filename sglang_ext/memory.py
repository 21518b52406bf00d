"""The plugin's device memory, inside SGLang's budget: what ``RowState`` allocates, and reserving it up front.

Per request row of SGLang's ``req_to_token`` pool (``max_running_requests`` + 1 rows: set
``--max-running-requests`` to what the rollouts need, SGLang's default is 2048-4096):

- the physical table, ``width`` int32 (the row width of ``req_to_token``: the context length + SGLang's extra);
- the query rings, ``layers x Hq x alpha x head_dim`` in the model dtype (compressing servers);
- the kept positions, ``layers x Hkv x (B + W)`` int32 (with ``kept_digest``);
- the query-center sums, ``layers x Hq x 3 head_dim / 2`` float32 (servers started with ``triattention``,
  ``query_centers``).

SGLang sizes its KV pool from ``mem_fraction_static`` before any attention backend exists; the plugin takes its
bytes out of that budget first (hook on ``KVCacheConfigurator._profile_available_bytes``, for the most rows
SGLang may give the pool: ``max_running_requests``, else 4096), so the KV pool shrinks by them instead of the
activation headroom, and allocates them in SGLang's KV-cache memory-saver region, so
``release/resume_memory_occupation`` frees them with the KV cache. A compressing step adds at most
``SCORE_CHUNK_BYTES`` of transients (``score_chunks``).
"""
from __future__ import annotations

from dataclasses import dataclass

from sglang_ext.score_chunks import SCORE_CHUNK_BYTES

SGLANG_MAX_DEFAULT_ROWS = 4096
"""The most request rows SGLang 0.5.23 gives the pool when --max-running-requests is unset
(``KVCacheConfigurator.resolve_max_num_reqs``: clamp(capacity / context * 512, 2048, 4096))."""
SGLANG_ROW_EXTRA = 4
"""``req_to_token`` row width beyond the context length without speculative decoding
(``allocation_sizing.get_req_to_token_extra_context_len``)."""
TABLE_BYTES, POSITION_BYTES, CENTER_BYTES = 4, 4, 4   # int32 table entries and kept positions, float32 sums


@dataclass(frozen=True)
class PluginMemory:
    """Bytes of the plugin's per-row tensors on one GPU (one TP rank)."""

    rows: int
    table: int
    queries: int
    positions: int
    centers: int = 0
    """The query-center sums (``query_centers``)."""
    transient: int = SCORE_CHUNK_BYTES
    """At most this much more while a step compresses."""

    @property
    def total(self) -> int:
        return self.table + self.queries + self.positions + self.centers

    def describe(self) -> str:
        gib = lambda x: f"{x / 2 ** 30:.2f} GiB"  # noqa: E731
        return (f"sparse_kv: {gib(self.total)} for {self.rows} rows (table {gib(self.table)}, query rings "
                f"{gib(self.queries)}, kept positions {gib(self.positions)}"
                + (f", query centers {gib(self.centers)}" if self.centers else "") + ") + at most "
                f"{self.transient / 2 ** 20:.0f} MiB while compressing")


def plugin_memory(*, rows: int, width: int, layers: int, q_heads: int, kv_heads: int, head_dim: int, window: int,
                  max_candidates: int, ring_itemsize: int, keep_queries: bool, keep_positions: bool,
                  keep_centers: bool = False) -> PluginMemory:
    """The formula ``RowState`` allocates by (heads per TP rank)."""
    return PluginMemory(
        rows=rows, table=rows * width * TABLE_BYTES,
        queries=layers * rows * q_heads * window * head_dim * ring_itemsize if keep_queries else 0,
        positions=layers * rows * kv_heads * max_candidates * POSITION_BYTES if keep_positions else 0,
        centers=layers * rows * q_heads * (head_dim + head_dim // 2) * CENTER_BYTES if keep_centers else 0)


def for_config(config, *, rows: int, width: int, layers: int, q_heads: int, kv_heads: int, head_dim: int,
               ring_itemsize: int) -> PluginMemory:
    """``plugin_memory`` of a ``SparseKVConfig`` (dense servers keep no rings or positions)."""
    c = config.compression
    return plugin_memory(rows=rows, width=width, layers=layers, q_heads=q_heads, kv_heads=kv_heads,
                         head_dim=head_dim, window=c.window, max_candidates=c.max_candidates,
                         ring_itemsize=ring_itemsize, keep_queries=not c.is_dense,
                         keep_positions=config.kept_digest and not c.is_dense, keep_centers=keeps_centers(c))


def keeps_centers(compression) -> bool:
    """A server with this compression keeps query-center sums: its scorer needs them (``query_centers``)."""
    from sparse_rl_megatron.compression.scorers import QUERY_CENTERS

    return QUERY_CENTERS in compression.scorer.needs


_RESERVED: PluginMemory | None = None
"""What this process took out of SGLang's KV budget before the pool was sized (None: not reserved)."""


def reserved() -> PluginMemory | None:
    return _RESERVED


def reserve_before_kv_pool(original, configurator, *args, **kwargs) -> int:
    """AROUND ``KVCacheConfigurator._profile_available_bytes``: SGLang's KV byte budget, less the plugin's."""
    global _RESERVED
    available = original(configurator, *args, **kwargs)
    if configurator.is_draft_worker:
        return available
    from sglang.srt.runtime_context import get_schedule, get_server_args

    from sglang_ext.config import config_from_env
    from sglang_ext.refusals import uses_sparse_kv

    if not uses_sparse_kv(get_server_args()):
        return available
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len

    mc, tp = configurator.model_config, int(get_parallel().attn_tp_size)
    rows = (get_schedule().max_running_requests or SGLANG_MAX_DEFAULT_ROWS) + 1   # + SGLang's padding row
    need = for_config(config_from_env(), rows=rows, width=mc.context_len + get_req_to_token_extra_context_len(),
                      layers=int(getattr(mc, "num_attention_layers", mc.num_hidden_layers)),
                      q_heads=mc.get_num_attention_heads(tp), kv_heads=mc.get_num_kv_heads(tp), head_dim=mc.head_dim,
                      ring_itemsize=configurator.model_dtype.itemsize)
    _RESERVED = need
    return max(int(available) - need.total, 0)
