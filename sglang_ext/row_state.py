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
- ``qsum``, ``qabs``, ``qcount``: TriAttention's running sums of the row's pre-RoPE queries (``query_centers``), for
  servers started with a scorer that needs them.
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
from sparse_rl_megatron.compression.scorers import QUERY_CENTERS


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
    digest_before: str | None = None
    """``meta['kept_digest']`` before the row's latest compression (see ``RowState.sync_meta``)."""


class RowState:
    """Device tables and CPU counters of every row; see the module docstring."""

    def __init__(self, *, rows: int, width: int, num_layers: int, num_kv_heads: int, num_q_heads: int,
                 head_dim: int, window: int, max_candidates: int, ring_dtype: torch.dtype,
                 device: torch.device | str, keep_queries: bool, keep_positions: bool, keep_centers: bool = False,
                 region=None):
        self.device = torch.device(device)
        with region if region is not None else contextlib.nullcontext():
            self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
            self.qwin = (torch.zeros(num_layers, rows, num_q_heads, window, head_dim, dtype=ring_dtype,
                                     device=device) if keep_queries else None)
            """[L, rows, Hq, alpha, D] the post-RoPE queries of each row's last alpha tokens (a ring per row)."""
            self.pos = (torch.zeros(num_layers, rows, num_kv_heads, max_candidates, dtype=torch.int32,
                                    device=device) if keep_positions else None)
            """[L, rows, Hkv, B + W] logical position of every candidate slot of a compressed row (digests)."""
            self.qsum = (torch.zeros(num_layers, rows, num_q_heads, head_dim, dtype=torch.float32, device=device)
                         if keep_centers else None)
            """[L, rows, Hq, D] sum of each row's pre-RoPE queries (``query_centers``)."""
            self.qabs = (torch.zeros(num_layers, rows, num_q_heads, head_dim // 2, dtype=torch.float32,
                                     device=device) if keep_centers else None)
            """[L, rows, Hq, D / 2] sum of the moduli of each row's pre-RoPE query pairs (``query_centers``)."""
        self.qcount = np.zeros(rows, dtype=np.int64)
        """Tokens summed into ``qsum`` / ``qabs`` per row (host)."""
        self.generation = np.full(rows, -1, dtype=np.int64)
        """``req_to_token_pool.req_generation`` when the row was last (re)initialised: a change = new request."""
        zeros = lambda dtype=np.int64: np.zeros(rows, dtype=dtype)  # noqa: E731
        self.phys_len, self.cand_start, self.ring_ptr = zeros(), zeros(), zeros()
        self.logical_len, self.events, self.peak = zeros(), zeros(), zeros()
        self.zero_lo, self.zero_hi = zeros(), zeros()
        self.compressed = zeros(bool)
        self.extras_released = zeros(bool)
        self.info: list[RowInfo | None] = [None] * rows
        # Each bound row's RowInfo facts as arrays (``set_info``), so a forward's decisions are numpy over the batch:
        self.bound = zeros(bool)
        self.dense = zeros(bool)
        self.centers = zeros(bool)
        """The row's scorer needs query centers (its queries are summed)."""
        self.alpha = zeros()
        """The row's query-ring width (its window alpha; 0 for dense rows, which are never scored)."""
        self.prompt_len = zeros()
        self.scope_response = zeros(bool)
        self.max_cand = zeros()
        """B + W of the row's compression (dense rows: never reached)."""
        self.config_id = zeros()
        """Id of the row's compression in ``configs`` (rows with one id compress together)."""
        self.configs: dict[int, CompressionConfig] = {}
        """The compressions bound rows use, by id: interned (one id per distinct config) and dropped with the last
        row that uses it, so at most one per row however many per-request overrides (the adaptive budget's) come."""
        self._config_ids: dict[str, int] = {}
        self._config_rows: dict[int, int] = {}
        """Bound rows per config id."""
        self._next_config_id = 0
        # ``meta``'s per-forward fields, kept here and written into the dict at release (``sync_meta``):
        self.meta_peak, self.peak_before, self.events_before = zeros(), zeros(), zeros()
        """The recorded peak (across a retracted request's attempts), and peak / events before the latest forward."""
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
        return sum(t.numel() * t.element_size() for t in (self.table, self.qwin, self.pos, self.qsum, self.qabs)
                   if t is not None)

    def reset(self, row: int, generation: int, info: RowInfo | None) -> None:
        """Start a new request in ``row``."""
        self.generation[row] = generation
        self.phys_len[row] = self.cand_start[row] = self.ring_ptr[row] = 0
        self.logical_len[row] = self.events[row] = self.peak[row] = 0
        self.zero_lo[row] = self.zero_hi[row] = 0
        self.compressed[row] = False
        self.extras_released[row] = False
        self.set_info(row, info)
        stale = self.pending_extras.pop(row, None)
        if stale is None:
            stale = self.extras.pop(row, None)
        if stale is not None:
            raise RuntimeError(f"sparse_kv: row {row} was reused with {stale.numel()} reserved slots never freed")
        if self.qwin is not None:
            self.qwin[:, row].zero_()
        self.qcount[row] = 0
        if self.qsum is not None:
            self.qsum[:, row].zero_()
            self.qabs[:, row].zero_()

    def set_info(self, row: int, info: RowInfo | None) -> None:
        """Bind ``info`` to ``row`` (its facts copied into the per-row arrays)."""
        if self.bound[row]:
            self._drop_config(int(self.config_id[row]))
        self.info[row] = info
        self.bound[row] = info is not None
        if info is None:
            return
        c = info.config
        self.config_id[row] = self._intern_config(c)
        self.dense[row] = c.is_dense
        self.alpha[row] = 0 if c.is_dense else c.window
        self.centers[row] = self.qsum is not None and not c.is_dense and QUERY_CENTERS in c.scorer.needs
        self.prompt_len[row] = info.prompt_len
        self.scope_response[row] = c.scope == "response"
        self.max_cand[row] = np.iinfo(np.int64).max if c.is_dense else c.max_candidates
        self.meta_peak[row] = self.peak_before[row] = int(info.meta.get("peak_kv_tokens", 0) or 0)
        self.events_before[row] = 0

    def _intern_config(self, config: CompressionConfig) -> int:
        """The id of ``config`` (a new one for a config no bound row uses), counting one more row on it."""
        key = repr(config)
        cid = self._config_ids.get(key)
        if cid is None:
            cid, self._next_config_id = self._next_config_id, self._next_config_id + 1
            self._config_ids[key] = cid
            self.configs[cid] = config
            self._config_rows[cid] = 0
        self._config_rows[cid] += 1
        return cid

    def _drop_config(self, cid: int) -> None:
        """One row less on config ``cid``; the config goes with its last row."""
        self._config_rows[cid] -= 1
        if self._config_rows[cid] == 0:
            del self._config_rows[cid], self._config_ids[repr(self.configs.pop(cid))]

    def before_forward(self, rows: np.ndarray) -> None:
        """``rows`` go into a forward: what ``meta`` would hold without it (``sync_meta(last_forward=False)``)."""
        self.peak_before[rows] = self.meta_peak[rows]
        self.events_before[rows] = self.events[rows]

    def after_plan(self, rows: np.ndarray) -> None:
        """The recorded peak follows the physical peak (a retracted request keeps its first attempt's)."""
        self.meta_peak[rows] = np.maximum(self.meta_peak[rows], self.peak[rows])

    def sync_meta(self, row: int, *, last_forward: bool = True) -> None:
        """Write the row's per-forward record into ``info.meta`` (what SGLang sends back), when SGLang releases the
        row (finish, retraction). ``last_forward=False``: as before the row's latest forward; with SGLang's overlap
        scheduler a finished request rides one more decode forward that feeds its last sampled token (never fed in
        the reference schedule), whose record is dropped."""
        info = self.info[row]
        if info is None or not info.meta:
            return
        if last_forward:
            info.meta["peak_kv_tokens"] = int(self.meta_peak[row])
            info.meta["events"] = int(self.events[row])
            return
        info.meta["peak_kv_tokens"] = int(self.peak_before[row])
        info.meta["events"] = int(self.events_before[row])
        if self.events[row] != self.events_before[row]:   # that forward compressed the row
            info.meta["kept_digest"] = info.digest_before

    def config(self, row: int) -> CompressionConfig | None:
        info = self.info[row]
        return None if info is None else info.config
