"""What the ``sparse_kv`` backend remembers per request row (a row of SGLang's ``req_to_token`` pool).

SGLang keeps its own table, ``req_to_token[row, p]`` = the KV slot of *logical* position p, and its own
logical lengths (``seq_lens``), which also give RoPE positions; the plugin never changes either meaning.
It keeps a second, *physical* table next to it:

- ``table[row, :phys_len[row]]``: the slots the attention kernels read, in cache order. Until the row's
  first compression it mirrors ``req_to_token[row, :seq_len]``. Afterwards it is
  ``[prompt slots (scope response only) | B kept slots | slots appended since]``: slot ``table[row, i]``
  holds, in layer l and KV head h, the token whose logical position is ``pos[l, row, h, i - cand_start]``.
- ``cand_start[row]``: leading table entries that are never candidates (the prompt for scope response).
- ``zero_lo[row], zero_hi[row]``: the positions of SGLang's row whose entries the plugin zeroed (evicted slots,
  freed): one contiguous range. The first compression frees the owned candidates past the B kept ones, SGLang
  positions ``[min(start + B, T1), T1)``; every later one frees the tokens appended since the previous, positions
  ``[T_prev, T)``; so what a row still owns is known on the host (``accounting``).
- ``extras[row]``: slots taken for the first compression of a scope-all request whose prompt the radix tree
  shares (they hold kept prompt tokens, in table positions every later compression keeps, until release).

Dynamic per-row numbers live on the CPU (decisions never wait for the device); tensors the kernels or the
scorers read (table, query ring, kept positions) live on the device, sized by ``memory.plugin_memory`` and
allocated inside ``region`` (SGLang's KV-cache memory-saver region on a server).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparse_rl_megatron.compression import CompressionConfig, KeptDigest


@dataclass
class RowInfo:
    """Per-request facts bound when SGLang hands the request a row (scheduler side)."""

    config: CompressionConfig
    """This request's compression (the server's, or its ``custom_params`` overrides)."""
    prompt_len: int
    """Prompt tokens (``len(req.origin_input_ids)``)."""
    req: Any = None
    """The scheduler's ``Req`` (None when a row is driven without a scheduler, e.g. unit tests)."""
    meta: dict = field(default_factory=dict)
    """The provenance dict sent back in ``meta_info['sparse_kv']`` (updated in place)."""
    digest: KeptDigest | None = None
    meta_before_last: dict | None = None
    """``meta`` as it was before the latest forward (see ``finalize_meta``)."""

    def finalize_meta(self, cached_now: int, fed_tokens: int) -> None:
        """At finish: with SGLang's overlap scheduler a finished request rides one more decode forward that
        feeds its last sampled token (never fed in the reference schedule); drop that forward's record."""
        if cached_now > fed_tokens and self.meta_before_last is not None:
            self.meta.update(self.meta_before_last)


class RowState:
    """Device tables and CPU counters of every row; see the module docstring."""

    def __init__(self, *, rows: int, width: int, num_layers: int, num_kv_heads: int, num_q_heads: int,
                 head_dim: int, window: int, max_candidates: int, ring_dtype: torch.dtype,
                 device: torch.device | str, keep_queries: bool, keep_positions: bool, region=None):
        self.device = torch.device(device)
        with region if region is not None else contextlib.nullcontext():
            self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
            self.qwin = (torch.zeros(num_layers, rows, num_q_heads, window, head_dim, dtype=ring_dtype,
                                     device=device) if keep_queries else None)
            """[L, rows, Hq, alpha, D] the post-RoPE queries of each row's last alpha tokens (a ring per row)."""
            self.pos = (torch.zeros(num_layers, rows, num_kv_heads, max_candidates, dtype=torch.int32,
                                    device=device) if keep_positions else None)
            """[L, rows, Hkv, B + W] logical position of every candidate slot of a compressed row (digests)."""
        self.generation = np.full(rows, -1, dtype=np.int64)
        """``req_to_token_pool.req_generation`` when the row was last (re)initialised: a change = new request."""
        zeros = lambda dtype=np.int64: np.zeros(rows, dtype=dtype)  # noqa: E731
        self.phys_len, self.cand_start, self.ring_ptr = zeros(), zeros(), zeros()
        self.logical_len, self.events, self.peak = zeros(), zeros(), zeros()
        self.zero_lo, self.zero_hi = zeros(), zeros()
        self.compressed = zeros(bool)
        self.extras_released = zeros(bool)
        self.info: list[RowInfo | None] = [None] * rows
        self.pending_extras: dict[int, torch.Tensor] = {}
        """Slots reserved by the scheduler for a row's first compression (scope all, shared prompt)."""
        self.extras: dict[int, torch.Tensor] = {}
        """Reserved slots a first compression used (see the module docstring), until the row is released."""

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    @property
    def nbytes(self) -> int:
        """Device bytes of the per-row tensors."""
        return sum(t.numel() * t.element_size() for t in (self.table, self.qwin, self.pos) if t is not None)

    def reset(self, row: int, generation: int, info: RowInfo | None) -> None:
        """Start a new request in ``row``."""
        self.generation[row] = generation
        self.phys_len[row] = self.cand_start[row] = self.ring_ptr[row] = 0
        self.logical_len[row] = self.events[row] = self.peak[row] = 0
        self.zero_lo[row] = self.zero_hi[row] = 0
        self.compressed[row] = False
        self.extras_released[row] = False
        self.info[row] = info
        stale = self.pending_extras.pop(row, None)
        if stale is None:
            stale = self.extras.pop(row, None)
        if stale is not None:
            raise RuntimeError(f"sparse_kv: row {row} was reused with {stale.numel()} reserved slots never freed")
        if self.qwin is not None:
            self.qwin[:, row].zero_()

    def config(self, row: int) -> CompressionConfig | None:
        info = self.info[row]
        return None if info is None else info.config
