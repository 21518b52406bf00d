"""Per-forward bookkeeping of the ``sparse_kv`` backend: physical tables and lengths, query-ring targets.

Called once per forward from ``init_forward_metadata`` (before the layers run). For every request row of
the batch it brings ``RowState.table`` up to date (mirror SGLang's logical row until the first compression;
afterwards append the slots SGLang allocated for this forward's tokens) and returns a copy of the
``ForwardBatch`` whose ``seq_lens`` / ``extend_prefix_lens`` are physical, for the inner backend. Logical
lengths and positions (RoPE) are left to SGLang.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

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


def _cpu(t) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def plan_forward(state: RowState, fb, *, req_to_token: torch.Tensor, req_generation: torch.Tensor,
                 default_info) -> ForwardPlan:
    """Update ``state`` for the forward described by ``fb`` and return its :class:`ForwardPlan`.

    ``default_info(row, prompt_len)`` builds the :class:`RowInfo` of a row no scheduler bound (unit tests).
    """
    rows = _cpu(fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None else fb.req_pool_indices)
    rows = rows.astype(np.int64)
    seq = _cpu(fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens).astype(np.int64)
    is_decode = bool(fb.forward_mode.is_decode())
    if is_decode:
        ext = np.ones_like(seq)
    else:
        ext = np.asarray(fb.extend_seq_lens_cpu if fb.extend_seq_lens_cpu is not None
                         else _cpu(fb.extend_seq_lens), dtype=np.int64)
    gens = _cpu(req_generation[torch.as_tensor(rows)])
    for i, row in enumerate(rows.tolist()):
        if state.generation[row] != gens[i]:           # a request the scheduler hook did not bind
            state.reset(row, int(gens[i]), default_info(row, int(seq[i])))
        elif state.info[row] is None:
            state.info[row] = default_info(row, int(seq[i]))
    _sync_tables(state, rows, seq, ext, fb.out_cache_loc, req_to_token, is_decode)
    phys = state.phys_len[rows]
    pb = copy.copy(fb)
    device = fb.seq_lens.device
    pb.seq_lens = torch.as_tensor(phys, dtype=fb.seq_lens.dtype).to(device)
    pb.seq_lens_cpu = torch.as_tensor(phys, dtype=torch.int64)
    pb.seq_lens_sum = int(phys.sum())
    if not is_decode:
        prefix = phys - ext
        pb.extend_prefix_lens = torch.as_tensor(prefix, dtype=fb.extend_prefix_lens.dtype).to(device)
        pb.extend_prefix_lens_cpu = prefix.tolist()
    plan = ForwardPlan(rows=rows, ext=ext, is_decode=is_decode, phys_batch=pb)
    if state.qwin is not None:
        _plan_ring_writes(state, plan, device)
    return plan


def _sync_tables(state: RowState, rows: np.ndarray, seq: np.ndarray, ext: np.ndarray, out_cache_loc,
                 req_to_token: torch.Tensor, is_decode: bool) -> None:
    """Mirror SGLang's rows where needed, append this forward's slots to compressed rows, set phys_len."""
    comp = state.compressed[rows]
    mirror = np.where(comp, state.cand_start[rows], seq)   # compressed rows: only the untouched prompt part
    width = int(mirror.max()) if len(mirror) else 0
    if width:
        idx = torch.as_tensor(rows, device=state.table.device)
        cols = torch.arange(width, device=state.table.device)
        keep = cols[None, :] >= torch.as_tensor(mirror, device=state.table.device)[:, None]
        state.table[idx[:, None], cols[None, :]] = torch.where(
            keep, state.table[idx, :width], req_to_token[idx, :width].to(state.table.dtype))
    if comp.any():
        starts = np.concatenate([[0], np.cumsum(ext)[:-1]])
        for i in np.nonzero(comp)[0].tolist():
            row, e, p = int(rows[i]), int(ext[i]), int(state.phys_len[rows[i]])
            state.table[row, p:p + e] = out_cache_loc[starts[i]:starts[i] + e].to(state.table.dtype)
            if state.pos is not None:   # the appended tokens' logical positions, the same in every layer and head
                c = p - int(state.cand_start[row])
                state.pos[:, row, :, c:c + e] = torch.arange(int(seq[i]) - e, int(seq[i]), device=state.pos.device)
    state.phys_len[rows] = np.where(comp, state.phys_len[rows] + ext, seq)
    state.logical_len[rows] = seq
    np.maximum.at(state.peak, rows, state.phys_len[rows])
    for row in rows[~comp].tolist():                     # uncompressed: candidates start per scope
        info: RowInfo = state.info[row]
        state.cand_start[row] = info.prompt_len if info.config.scope == "response" else 0


def _plan_ring_writes(state: RowState, plan: ForwardPlan, device) -> None:
    """The last min(ext, alpha) queries of every row go to its ring, oldest slot first; the pointer advances."""
    tokens, ring_rows, slots = [], [], []
    start = 0
    for row, e in zip(plan.rows.tolist(), plan.ext.tolist()):
        config = state.info[row].config
        if config.is_dense:   # never scored
            start += e
            continue
        alpha = config.window
        ptr = int(state.ring_ptr[row])
        m = min(e, alpha)
        for j in range(m):
            tokens.append(start + e - m + j)
            ring_rows.append(row)
            slots.append((ptr + e - m + j) % alpha)
        state.ring_ptr[row] = (ptr + e) % alpha
        start += e
    as_t = lambda x: torch.as_tensor(x, dtype=torch.int64).to(device)  # noqa: E731
    plan.ring_tokens, plan.ring_rows, plan.ring_slots = as_t(tokens), as_t(ring_rows), as_t(slots)
