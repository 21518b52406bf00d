"""Per-forward bookkeeping of the ``sparse_kv`` backend: physical tables and lengths, query-ring targets.

Called once per forward from ``init_forward_metadata`` (before the layers run). For every request row of
the batch it brings ``RowState.table`` up to date and returns a copy of the ``ForwardBatch`` whose
``seq_lens`` / ``extend_prefix_lens`` are physical, for the inner backend. Logical lengths and positions
(RoPE) are left to SGLang.

Every row caches ``e`` tokens (1 for decode) whose slots are this forward's ``out_cache_loc``; they go to
table positions ``[p, p + e)``, ``p`` = the physical length so far (uncompressed rows: ``p`` = the logical prefix,
the same slots SGLang wrote into its row). An uncompressed row whose table lags SGLang's row (a new request, a
radix-cache prefix) first mirrors the missing prefix. Entries SGLang *rewrites* after they were mirrored (the radix
cache's checkpoint after every prefill or chunk points a row at the tree's slots and frees the request's duplicates)
are followed when SGLang writes them (:func:`follow_rewrite`, hooked on ``ReqToTokenPool.write``), before the freed
slots can be handed to another request. No host sync: the decisions use host numbers
(``req_pool_indices_cpu``, which the plugin's ``ForwardBatch.init_new`` hook fills for decode batches too,
``seq_lens_cpu``, ``RowState``), and every index the device needs is sent in one asynchronous copy
(``host_syncs.to_device``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from sglang_ext.host_syncs import not_counted, to_device, to_host
from sglang_ext.row_state import RowInfo, RowState

@dataclass
class ForwardPlan:
    """What one forward does to the rows (kept until the compaction check after the forward)."""

    rows: np.ndarray
    """[bs] request rows, batch order."""
    ext: np.ndarray
    """[bs] tokens each row caches in this forward (1 for decode)."""
    is_decode: bool
    phys_batch: object
    """The ForwardBatch copy with physical lengths, handed to the inner backend."""
    ring_tokens: torch.Tensor | None = None
    """[T'] index (into this forward's query rows) of every query that goes into a ring."""
    ring_rows: torch.Tensor | None = None
    """[T'] its request row."""
    ring_slots: torch.Tensor | None = None
    """[T'] its slot in that row's ring."""
    ring_count: int = 0
    """T' (host)."""
    center_tokens: torch.Tensor | None = None
    """[T''] index of every query summed into its row's query centers (every token of a row that keeps them)."""
    center_rows: torch.Tensor | None = None
    """[T''] its request row."""
    center_positions: torch.Tensor | None = None
    """[T''] its logical (RoPE) position."""
    center_count: int = 0
    """T'' (host)."""
    rows_from_host: bool = False
    """The batch's rows came from the host (recorded when SGLang built it), not read from the device."""


def sglang_host(t) -> np.ndarray:
    """One of SGLang's host-side values (``seq_lens_cpu``, ``extend_seq_lens_cpu``, ``req_generation``, the rows
    recorded at batch build) as numpy; a tensor on a device is read with a (counted) sync."""
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            return to_host(t)
        with not_counted():   # already on the host
            return t.detach().numpy()
    return np.asarray(t)


def _host_fields(fb):
    # the rows on the host: SGLang's for extends, the plugin's ForwardBatch.init_new hook's for decodes
    from_host = fb.req_pool_indices_cpu is not None
    rows = fb.req_pool_indices_cpu if from_host else to_host(fb.req_pool_indices)
    rows = sglang_host(rows).astype(np.int64)
    seq = (sglang_host(fb.seq_lens_cpu) if fb.seq_lens_cpu is not None else to_host(fb.seq_lens)).astype(np.int64)
    is_decode = bool(fb.forward_mode.is_decode())
    if is_decode:
        ext = np.ones_like(seq)
    elif fb.extend_seq_lens_cpu is not None:
        ext = np.asarray(fb.extend_seq_lens_cpu, dtype=np.int64)
    else:
        ext = to_host(fb.extend_seq_lens).astype(np.int64)
    return rows, seq, ext, is_decode, from_host


def plan_forward(state: RowState, fb, *, req_to_token: torch.Tensor, req_generation: torch.Tensor,
                 default_info) -> ForwardPlan:
    """Update ``state`` for the forward described by ``fb`` and return its :class:`ForwardPlan`.

    ``default_info(row, prompt_len)`` builds the :class:`RowInfo` of a row no scheduler bound (unit tests).
    """
    rows, seq, ext, is_decode, from_host = _host_fields(fb)
    with_generation = sglang_host(req_generation)[rows]
    for i in np.nonzero(state.generation[rows] != with_generation)[0].tolist():   # a row no scheduler hook bound
        state.reset(int(rows[i]), int(with_generation[i]), default_info(int(rows[i]), int(seq[i])))
    for i in np.nonzero(~state.bound[rows])[0].tolist():
        state.set_info(int(rows[i]), default_info(int(rows[i]), int(seq[i])))
    state.before_forward(rows)
    comp = state.compressed[rows]
    start = np.where(comp, state.phys_len[rows], seq - ext)             # table position of this forward's tokens
    lag = np.where(comp, 0, np.maximum(start - state.phys_len[rows], 0))   # uncompressed prefix to mirror
    mirror_from = start - lag
    tok_start = np.concatenate([[0], np.cumsum(ext)[:-1]]).astype(np.int64)
    # one host->device copy: the physical lengths, then every table index this forward writes
    phys = start + ext
    app_rows, app_cols, app_toks = _ranges(rows, start, ext, tok_start)
    mir_rows, mir_cols, _ = _ranges(rows, mirror_from, lag, np.zeros_like(lag))
    pos_rows, pos_cols, pos_vals = (np.zeros(0, np.int64),) * 3
    if state.pos is not None and comp.any():   # the appended tokens' logical positions (kept digests)
        which = np.repeat(np.arange(len(rows)), ext)
        sel = comp[which]
        pos_rows = app_rows[sel]
        pos_cols = app_cols[sel] - state.cand_start[pos_rows]
        pos_vals = app_cols[sel] - start[which][sel] + (seq - ext)[which][sel]
    ring = _ring_writes(state, rows, ext, tok_start) if state.qwin is not None else None
    parts = [phys, app_rows, app_cols, app_toks, mir_rows, mir_cols, pos_rows, pos_cols, pos_vals, phys - ext]
    centers = _center_writes(state, rows, seq, ext, tok_start) if state.qsum is not None else None
    staged = _send(parts + (list(ring) if ring is not None else []) + (list(centers) if centers is not None else []),
                   req_to_token.device)
    phys_t, app_rows_t, app_cols_t, app_toks_t, mir_rows_t, mir_cols_t, pos_rows_t, pos_cols_t, pos_vals_t = staged[:9]
    if len(mir_rows):
        state.table[mir_rows_t, mir_cols_t] = req_to_token[mir_rows_t, mir_cols_t].to(state.table.dtype)
    if len(app_rows):
        state.table[app_rows_t, app_cols_t] = fb.out_cache_loc[app_toks_t].to(state.table.dtype)
    if len(pos_rows):
        state.pos[:, pos_rows_t, :, pos_cols_t] = pos_vals_t[:, None, None].to(state.pos.dtype)
    state.phys_len[rows] = phys
    state.logical_len[rows] = seq
    np.maximum.at(state.peak, rows, phys)
    state.after_plan(rows)
    fresh = rows[~comp]                                            # uncompressed: candidates start per scope
    state.cand_start[fresh] = np.where(state.scope_response[fresh], state.prompt_len[fresh], 0)
    pb = copy.copy(fb)
    pb.seq_lens = phys_t.to(fb.seq_lens.dtype)
    pb.seq_lens_cpu = torch.from_numpy(phys.copy())
    pb.seq_lens_sum = int(phys.sum())
    if not is_decode:
        pb.extend_prefix_lens = staged[9].to(fb.extend_prefix_lens.dtype)
        pb.extend_prefix_lens_cpu = (phys - ext).tolist()
    plan = ForwardPlan(rows=rows, ext=ext, is_decode=is_decode, phys_batch=pb, rows_from_host=from_host)
    if ring is not None:
        plan.ring_tokens, plan.ring_rows, plan.ring_slots = staged[10:13]
        plan.ring_count = len(ring[0])
    if centers is not None:
        plan.center_tokens, plan.center_rows, plan.center_positions = staged[-3:]
        plan.center_count = len(centers[0])
    return plan


def follow_rewrite(state: RowState, row: int, positions: np.ndarray, req_to_token: torch.Tensor, *,
                   radix: bool) -> None:
    """SGLang rewrote ``req_to_token[row, positions]`` (``positions`` on the host): the table entries that mirror
    those positions take the new slots. An uncompressed row mirrors its first ``phys_len`` positions; a compressed
    row only its first ``cand_start`` (the prompt, scope response): its other entries are kept slots, which SGLang
    may not rewrite. Positions past what the row has cached are new tokens (the forward's plan reads them)."""
    info = state.info[row]
    if info is None or len(positions) == 0:
        return
    if state.compressed[row]:
        limit = int(state.cand_start[row])
        # scope all with the radix cache on: the first compression copied the kept prompt tokens out of the
        # tree-shared prompt, so the table holds no prompt position (the tree may repoint them)
        ignored = info.prompt_len if radix and info.config.scope == "all" else 0
        bad = positions[(positions >= max(limit, ignored)) & (positions < state.logical_len[row])]
        if len(bad):
            raise RuntimeError(f"sparse_kv: SGLang rewrote positions {bad[:8].tolist()} of compressed request row "
                               f"{row} (candidates start at {limit}, {int(state.logical_len[row])} cached): those "
                               "entries hold kept slots the plugin's table no longer mirrors")
    else:
        limit = int(state.phys_len[row])
    mirrored = positions[positions < limit]
    if len(mirrored) == 0:
        return
    lo, hi = int(mirrored.min()), int(mirrored.max()) + 1
    if hi - lo == len(mirrored):   # a range (the radix checkpoint's slice): no index tensor
        state.table[row, lo:hi] = req_to_token[row, lo:hi].to(state.table.dtype)
    else:
        (cols,) = _send([mirrored], req_to_token.device)
        state.table[row, cols] = req_to_token[row, cols].to(state.table.dtype)


def written_positions(indices, width: int) -> list[tuple[int, np.ndarray]]:
    """``(row, positions)`` of a ``ReqToTokenPool.write(indices, ...)``: ``(row, slice)`` (the radix checkpoint,
    the extend fallback) on the host; ``(rows, columns)`` tensors are read (a counted sync on a device)."""
    if not (isinstance(indices, tuple) and len(indices) == 2):
        raise RuntimeError(f"sparse_kv: ReqToTokenPool.write with indices {type(indices).__name__} it cannot follow")
    first, second = indices
    if isinstance(second, slice):
        start, stop, step = second.indices(width)
        rows = [int(first)] if not isinstance(first, torch.Tensor) or first.dim() == 0 else \
            sglang_host(first).tolist()
        return [(r, np.arange(start, stop, step, dtype=np.int64)) for r in rows]
    rows = sglang_host(first).astype(np.int64).reshape(-1)
    cols = sglang_host(second).astype(np.int64)
    cols = np.broadcast_to(cols, (len(rows),) + cols.shape[1:]) if cols.ndim else np.full(len(rows), int(cols))
    if cols.ndim == 1:
        cols = cols[:, None]
    out: dict[int, list] = {}
    for r, c in zip(rows.tolist(), cols):
        out.setdefault(r, []).append(c)
    return [(r, np.concatenate(cs)) for r, cs in out.items()]


def check_tables(state: RowState, rows: np.ndarray, req_to_token: torch.Tensor) -> dict[int, str]:
    """Test-only (``check_tables``): every table entry that mirrors SGLang's row equals it (uncompressed rows:
    the physical length; compressed: the first ``cand_start``). Returns ``{row: what differs}``; reads the device."""
    drift = {}
    with not_counted():   # a diagnostic, off by default
        for row in rows.tolist():
            n = int(state.cand_start[row] if state.compressed[row] else state.phys_len[row])
            ours, theirs = state.table[row, :n], req_to_token[row, :n].to(state.table.dtype)
            if n and not torch.equal(ours, theirs):
                where = torch.nonzero(ours != theirs)[:, 0]
                kind = "compressed" if state.compressed[row] else "uncompressed"
                drift[row] = (f"sparse_kv check_tables: row {row} ({kind}) reads slots {ours[where][:8].tolist()} "
                              f"at positions {where[:8].tolist()}, SGLang's row has {theirs[where][:8].tolist()}")
    return drift


def _ranges(rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray, tok_starts: np.ndarray):
    """(row, column, token) of every position ``starts[i] + j``, ``j < lengths[i]``, flattened in batch order."""
    total = int(lengths.sum())
    if total == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    which = np.repeat(np.arange(len(rows)), lengths)
    offset = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return rows[which], starts[which] + offset, tok_starts[which] + offset


def _send(parts: list[np.ndarray], device) -> list[torch.Tensor]:
    """The int64 arrays ``parts`` on the device, in one copy."""
    sizes = [len(p) for p in parts]
    flat = to_device(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]), device)
    return list(torch.split(flat, sizes))


def _ring_writes(state: RowState, rows: np.ndarray, ext: np.ndarray, tok_start: np.ndarray):
    """(tokens, rows, slots): the last min(ext, alpha) queries of every row go to its ring, oldest slot first;
    the ring pointers advance. Dense requests are never scored: no ring writes."""
    alpha = state.alpha[rows]
    take = np.minimum(ext, alpha)
    total = int(take.sum())
    which = np.repeat(np.arange(len(rows)), take)
    j = np.arange(total) - np.repeat(np.cumsum(take) - take, take)             # 0 .. take-1 per row
    first = (ext - take)[which]                                                 # the older tokens are skipped
    tokens = tok_start[which] + first + j
    slots = (state.ring_ptr[rows][which] + first + j) % np.maximum(alpha[which], 1)
    state.ring_ptr[rows] = np.where(alpha > 0, (state.ring_ptr[rows] + ext) % np.maximum(alpha, 1),
                                    state.ring_ptr[rows])
    return tokens, rows[which], slots


def _center_writes(state: RowState, rows: np.ndarray, seq: np.ndarray, ext: np.ndarray, tok_start: np.ndarray):
    """(tokens, rows, positions): every query of the rows that keep query centers is summed; their counts grow."""
    take = np.where(state.centers[rows], ext, 0)
    state.qcount[rows] += take
    which = np.repeat(np.arange(len(rows)), take)
    j = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
    return tok_start[which] + j, rows[which], (seq - ext)[which] + j
