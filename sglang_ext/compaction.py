"""After each forward: which rows compress, and the compression itself (score, gather, free).

When (``sparse_rl_megatron.compression.schedule``): after a forward that cached decode tokens, a row whose
candidate count reached B + W keeps B candidates per layer and KV head. A plain prefill never compresses
(prefill compression is refused at start); an extend that re-caches response tokens (a retracted request
re-prefilled before its first event) follows the decode rule, as the tokens would have.

How, for the rows due with one config and one candidate count, layer by layer: the candidates' post-RoPE
keys and values are read from SGLang's pool through the physical table, the row's last alpha queries from
its ring (oldest first), ``compression.choose_kept`` picks B per KV head (the same code the HF reference
engine runs), and the kept K/V are written into the row's first B owned candidate slots. The other owned
candidate slots are freed and their entries in SGLang's ``req_to_token`` row zeroed (so nothing frees them
twice). Slots SGLang's radix tree shares (the prompt, scope ``all``, radix cache on) are only read: the
kept prompt tokens are copied into the row's own slots, plus slots the scheduler reserved beforehand
(``accounting.reserve_extras``) when the row owns fewer than B.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import numpy as np
import torch

from sglang_ext.accounting import owned_slots, take_extras
from sglang_ext.config import FAULT_ENV
from sparse_rl_megatron.compression import ScoreInputs, choose_kept, gather_kept, get_scorer


def compress_due_rows(backend, plan) -> None:
    """Compress the rows of ``plan`` that are due (see the module docstring) and refresh their provenance."""
    state = backend.state
    groups: dict[tuple, list[int]] = defaultdict(list)
    for row in plan.rows.tolist():
        info = state.info[row]
        info.meta_before_last = dict(info.meta)
        info.meta["peak_kv_tokens"] = max(info.meta["peak_kv_tokens"], int(state.peak[row]))
        cfg = info.config
        if cfg.is_dense or not (plan.is_decode or state.logical_len[row] > info.prompt_len):
            continue
        n = int(state.phys_len[row] - state.cand_start[row])
        if n >= cfg.max_candidates:
            groups[(repr(cfg), n)].append(row)
    stats = backend.config.stats_path
    backend.forwards += 1
    usage = pool_usage(backend, plan) if stats and backend.forwards % backend.config.stats_every == 0 else None
    cpu = time.process_time()
    for (_, n), rows in groups.items():
        compress_rows(backend, rows, n)
    if stats:
        backend.compact_cpu += time.process_time() - cpu
    if usage is not None:
        usage.update(compressing=sum(len(g) for g in groups.values()), cpu=time.process_time(),
                     compact_cpu=backend.compact_cpu)
        _append(backend, usage)
        backend._last_idle = None


def compress_rows(backend, rows: list[int], n: int) -> None:
    """Compress ``rows`` (same config, ``n`` candidates each) down to B candidates per layer and KV head."""
    state, pool = backend.state, backend.token_to_kv_pool
    cfg = state.info[rows[0]].config
    budget, window = cfg.budget, cfg.window
    device = state.table.device
    rows_t = torch.as_tensor(rows, device=device)
    starts = torch.as_tensor(state.cand_start[rows], device=device)
    cand = state.table[rows_t[:, None], starts[:, None] + torch.arange(n, device=device)].long()   # [m, n]
    dst, freed = _destinations(backend, rows, cand, budget)
    first = ~state.compressed[rows]
    positions = _candidate_positions(state, rows, n, first) if state.pos is not None else None
    queries_needed = get_scorer(cfg.method).needs_queries
    order = torch.as_tensor(np.stack([(state.ring_ptr[r] + np.arange(window)) % window for r in rows]),
                            device=device)                                                     # [m, alpha]
    kept_positions = []
    for li, layer_id in enumerate(backend.layer_ids):
        kbuf, vbuf = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        keys = kbuf[cand].permute(0, 2, 1, 3)                                                   # [m, Hkv, n, D]
        values = vbuf[cand].permute(0, 2, 1, 3)
        queries = None
        if queries_needed:
            ring = state.qwin[li][rows_t]                                                       # [m, Hq, a, D]
            queries = torch.gather(ring, 2, order[:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[3]))
        kept = choose_kept(cfg, ScoreInputs(keys=keys, values=values, queries=queries,
                                            scaling=backend.scaling.get(layer_id)))            # [m, Hkv, B]
        kbuf[dst] = gather_kept(keys, kept).permute(0, 2, 1, 3).to(kbuf.dtype)
        vbuf[dst] = gather_kept(values, kept).permute(0, 2, 1, 3).to(vbuf.dtype)
        if positions is not None:
            kept_pos = gather_kept(positions[li].unsqueeze(-1), kept).squeeze(-1)               # [m, Hkv, B]
            state.pos[li, rows_t, :, :budget] = kept_pos
            kept_positions.append(kept_pos)
    _give_back(backend, rows, freed)
    for i, row in enumerate(rows):
        start = int(state.cand_start[row])
        state.table[row, start:start + budget] = dst[i].to(state.table.dtype)
        state.phys_len[row] = start + budget
        info = state.info[row]
        if info.digest is not None:
            info.digest.update_layers(int(state.events[row]), torch.stack([p[i] for p in kept_positions]))
            info.meta["kept_digest"] = info.digest.hexdigest()
        state.events[row] += 1
        info.meta["events"] = int(state.events[row])
    state.compressed[rows] = True


def _destinations(backend, rows: list[int], cand: torch.Tensor, budget: int):
    """[m, B] slots that receive the kept K/V, and the [k] owned candidate slots to free."""
    state = backend.state
    dst, freed = [], []
    for i, row in enumerate(rows):
        owned = cand[i]
        info = state.info[row]
        if backend.radix_enabled and not state.compressed[row] and info.config.scope == "all":
            owned = owned[min(info.prompt_len, owned.numel()):]   # the prompt's slots belong to the radix tree
        if owned.numel() >= budget:
            dst.append(owned[:budget])
            freed.append(owned[budget:])
        else:
            dst.append(torch.cat([owned, take_extras(backend, row, budget - owned.numel())]))
    empty = cand.new_zeros(0)
    return torch.stack(dst), (torch.cat(freed) if freed else empty)


def _candidate_positions(state, rows: list[int], n: int, first: np.ndarray) -> torch.Tensor:
    """[L, m, Hkv, n] logical position of every candidate slot, per layer and KV head."""
    layers, _, heads, _ = state.pos.shape
    out = torch.empty(layers, len(rows), heads, n, dtype=state.pos.dtype, device=state.pos.device)
    for i, row in enumerate(rows):
        if first[i]:   # never compressed: the candidates are consecutive logical positions (n may exceed B + W)
            start = int(state.cand_start[row])
            out[:, i] = torch.arange(start, start + n, device=state.pos.device)
        else:
            out[:, i] = state.pos[:, row, :, :n]
    return out


def _give_back(backend, rows: list[int], freed: torch.Tensor) -> None:
    """Return evicted slots to the allocator and zero them in SGLang's rows (its release frees the rest)."""
    if freed.numel() == 0 or not backend.config.free_evicted:
        return
    rtt = backend.req_to_token_pool.req_to_token
    gone = freed.to(rtt.dtype)
    for row in rows:
        seg = rtt[row, : int(backend.state.logical_len[row])]
        seg[torch.isin(seg, gone)] = 0
    if os.environ.get(FAULT_ENV) == "skip_free":
        return  # fault injection for tests: the slots leave the request but never reach the free list
    backend.allocator.free(freed)


def pool_usage(backend, plan) -> dict:
    """Pool usage read from SGLang's allocator and rows: slots in use, held by the radix tree, owned by each
    request of the batch (all, and past its prompt), and the physical lengths the kernels read."""
    alloc = backend.allocator
    tree = backend.tree_cache
    rows = plan.rows.tolist()
    return {"decode": plan.is_decode, "running": len(rows), "used": int(alloc.size - alloc.available_size()),
            "tree": 0 if tree is None else int(tree.evictable_size()) + int(tree.protected_size()),
            "owned": [owned_slots(backend, r) for r in rows],
            "owned_response": [owned_slots(backend, r, beyond_prompt=True) for r in rows],
            "phys": [int(backend.state.phys_len[r]) for r in rows]}


def _append(backend, line: dict) -> None:
    with open(backend.config.stats_path, "a") as f:
        f.write(json.dumps(line) + "\n")


def record_idle(backend, pool_stats, *, total: int, leak: bool) -> None:
    """One JSON line of the idle pool (SGLang's own counters), written once per change or after forwards."""
    tree = backend.tree_cache
    line = {"idle": True, "total": int(total), "available": int(pool_stats.full_available_size),
            "evictable": int(pool_stats.full_evictable_size),
            "protected": 0 if tree is None else int(tree.protected_size()), "leak": leak}
    if line != backend._last_idle:
        backend._last_idle = line
        _append(backend, line)
