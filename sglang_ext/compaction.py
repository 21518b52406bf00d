"""After each forward: which rows compress, and the compression itself (score, gather, free).

When (``sparse_rl_megatron.compression.schedule``): after a forward that cached decode tokens, a row whose
candidate count reached B + W keeps B candidates per layer and KV head. A plain prefill never compresses
(prefill compression is refused at start); an extend that re-caches response tokens (a retracted request
re-prefilled before its first event) follows the decode rule, as the tokens would have.

How, for the rows due with one config and one candidate count, layer by layer and in chunks of rows and KV
heads (``score_chunks``: the transient scorer memory, R-KV's n x n similarity above all, stays under
``SCORE_CHUNK_BYTES`` however many rows compress at once): the candidates' post-RoPE keys and values are read from
SGLang's pool through the physical table, the row's last alpha queries from its ring (oldest first; with TP above
the KV head count, the KV head's whole query group, ``tp_heads``), ``compression.choose_kept`` picks B per KV head
(the same code the HF reference engine runs), and the kept K/V are written into the row's first B owned
candidate slots. The other owned candidate slots are freed and their entries in SGLang's ``req_to_token`` row
zeroed (a contiguous range, see ``row_state``). Slots SGLang's radix tree shares (the prompt, scope ``all``,
radix cache on) are only read: the kept prompt tokens are copied into the row's own slots, plus slots the
scheduler reserved beforehand (``accounting.reserve_extras``) when the row owns fewer than B.

Host syncs: none, except one device-to-host copy per compressing step for the kept digests (``kept_digest``).
"""
from __future__ import annotations

import json
import time
from collections import defaultdict

import numpy as np
import torch

from sglang_ext.accounting import owned_slots, take_extras
from sglang_ext.forward_plan import _send
from sglang_ext.host_syncs import not_counted, to_host
from sglang_ext import score_chunks as chunking
from sglang_ext.score_chunks import score_chunks
from sparse_rl_megatron.compression import ScoreInputs, choose_kept, gather_kept, get_scorer
from sparse_rl_megatron.compression.scorers import QUERY_CENTERS, QUERY_WINDOW


def compress_due_rows(backend, plan) -> None:
    """Compress the rows of ``plan`` that are due (see the module docstring) and refresh their provenance."""
    state = backend.state
    groups: dict[tuple, list[int]] = defaultdict(list)
    rows = plan.rows
    n = state.phys_len[rows] - state.cand_start[rows]
    due = ~state.dense[rows] & (n >= state.max_cand[rows])
    if not plan.is_decode:   # an extend compresses only rows that re-cache response tokens
        due &= state.logical_len[rows] > state.prompt_len[rows]
    for i in np.nonzero(due)[0].tolist():
        groups[(int(state.config_id[rows[i]]), int(n[i]))].append(int(rows[i]))
    stats = backend.config.stats_path
    backend.forwards += 1
    usage = None
    if stats and backend.forwards % backend.config.stats_every == 0:
        with not_counted():   # diagnostics
            usage = pool_usage(backend, plan)
    cpu = time.process_time()
    digests = []
    for (_, n), rows in groups.items():
        kept = compress_rows(backend, rows, n)
        if kept is not None:
            digests.append(kept)
    _update_digests(state, digests)
    if stats:
        backend.compact_cpu += time.process_time() - cpu
    if usage is not None:
        usage.update(compressing=sum(len(g) for g in groups.values()), cpu=time.process_time(),
                     compact_cpu=backend.compact_cpu, host_rows=plan.rows_from_host)
        counter = backend.sync_counter
        if counter is not None:   # what the hooks cost since the previous line (this forward, its scheduling)
            usage.update(host_syncs=counter.total - backend.syncs_logged, staged=counter.staged)
            backend.syncs_logged = counter.total
        _append(backend, usage)
        backend._last_idle = None


def compress_rows(backend, rows: list[int], n: int):
    """Compress ``rows`` (same config, ``n`` candidates each) down to B candidates per layer and KV head.
    Returns ``(rows, events, kept_positions [L, m, Hkv, B])`` for the kept digests, or None without them."""
    state, pool = backend.state, backend.token_to_kv_pool
    cfg = state.info[rows[0]].config
    budget, window = cfg.budget, cfg.window
    device = state.table.device
    rows_np = np.asarray(rows, dtype=np.int64)
    starts = state.cand_start[rows_np]
    first = ~state.compressed[rows_np]
    own_from = _owned_from(backend, rows_np, n)
    order = (state.ring_ptr[rows_np][:, None] + np.arange(window)) % window
    zero_rows, zero_cols = _zero_range(backend, rows_np, n, own_from, budget)
    rows_t, starts_t, order_t, first_t, zero_rows_t, zero_cols_t, count_t, next_t = _send(
        [rows_np, starts, order.ravel(), first.astype(np.int64), zero_rows, zero_cols, state.qcount[rows_np],
         state.logical_len[rows_np]], device)
    order_t, first_t = order_t.view(len(rows), window), first_t.bool()
    cand = state.table[rows_t[:, None], starts_t[:, None] + torch.arange(n, device=device)].long()   # [m, n]
    dst, freed = _destinations(backend, rows, cand, own_from, budget)
    positions = _candidate_positions(state, rows_t, starts_t, first_t, n) if state.pos is not None else None
    scorer = get_scorer(cfg.method)
    head_dim = pool.head_dim
    kept_positions = []
    for li, layer_id in enumerate(backend.layer_ids):
        kbuf, vbuf = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        kept_pos = torch.empty(len(rows), pool.head_num, budget, dtype=state.pos.dtype, device=device) \
            if positions is not None else None
        for rs, head_slices in score_chunks(len(rows), pool.head_num, pair_bytes=_pair_bytes(cfg, n, head_dim),
                                            row_bytes=_row_bytes(n, pool.head_num, head_dim, kbuf.element_size()),
                                            budget=chunking.SCORE_CHUNK_BYTES):
            keys = kbuf[cand[rs]].permute(0, 2, 1, 3)                                    # [mc, Hkv, n, D]
            values = vbuf[cand[rs]].permute(0, 2, 1, 3)
            queries = None
            if QUERY_WINDOW in scorer.needs:
                ring = state.qwin[li][rows_t[rs]]                                       # [mc, Hq, a, D]
                index = order_t[rs][:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[3])
                queries = backend.query_groups.whole_group(torch.gather(ring, 2, index))
            centers = (_centers(backend, li, rows_t[rs], count_t[rs], next_t[rs])
                       if QUERY_CENTERS in scorer.needs else {})
            kept = _choose(cfg, keys, values, queries, backend.scaling.get(layer_id), head_slices,
                           centers)                                                      # [mc, Hkv, B]
            kbuf[dst[rs]] = gather_kept(keys, kept).permute(0, 2, 1, 3).to(kbuf.dtype)
            vbuf[dst[rs]] = gather_kept(values, kept).permute(0, 2, 1, 3).to(vbuf.dtype)
            if positions is not None:
                kept_pos[rs] = gather_kept(positions[li, rs].unsqueeze(-1), kept).squeeze(-1)
        if positions is not None:
            state.pos[li, rows_t, :, :budget] = kept_pos
            kept_positions.append(kept_pos)
    _give_back(backend, zero_rows_t, zero_cols_t, freed)
    state.table[rows_t[:, None], starts_t[:, None] + torch.arange(budget, device=device)] = dst.to(state.table.dtype)
    events = state.events[rows_np].copy()
    state.phys_len[rows_np] = starts + budget
    state.events[rows_np] += 1
    state.compressed[rows_np] = True
    if not kept_positions or all(state.info[r].digest is None for r in rows):
        return None
    return rows, events, torch.stack(kept_positions)


def _centers(backend, li: int, rows_t, count_t, next_t) -> dict:
    """TriAttention's ``ScoreInputs`` fields of a row chunk in layer ``li``: the mean pre-RoPE query and pair modulus
    of each query head (the KV head's whole group with TP replicas, ``tp_heads``), the next position, the rotary."""
    count = count_t.clamp_min(1).to(torch.float32)[:, None, None]
    groups = backend.query_groups
    center = groups.whole_group((backend.state.qsum[li][rows_t] / count).unsqueeze(-2)).squeeze(-2)
    abs_center = groups.whole_group((backend.state.qabs[li][rows_t] / count).unsqueeze(-2)).squeeze(-2)
    return dict(query_center=center, query_abs_center=abs_center, query_position=next_t,
                rope_inv_freq=backend.inv_freq)


_PER_QUERY_HEAD = ("queries", "query_center", "query_abs_center")
"""``ScoreInputs`` fields with one entry per query head (dim 1), sliced with their KV heads."""


def _choose(cfg, keys, values, queries, scaling, head_slices: list[slice], centers: dict) -> torch.Tensor:
    """``choose_kept`` of a row chunk, KV heads a slice at a time (each with its query heads); [mc, Hkv, B]."""
    if len(head_slices) == 1:
        return choose_kept(cfg, ScoreInputs(keys=keys, values=values, queries=queries, scaling=scaling, **centers))
    kept = torch.empty(keys.shape[0], keys.shape[1], cfg.budget, dtype=torch.int64, device=keys.device)
    per_head = {name: x for name, x in (("queries", queries), *centers.items())
                if name in _PER_QUERY_HEAD and x is not None}
    rest = {name: x for name, x in centers.items() if name not in _PER_QUERY_HEAD}
    for hs in head_slices:
        sliced = {}
        for name, x in per_head.items():
            group = x.shape[1] // keys.shape[1]
            sliced[name] = x[:, hs.start * group:hs.stop * group]
        kept[:, hs] = choose_kept(cfg, ScoreInputs(keys=keys[:, hs], values=values[:, hs], scaling=scaling,
                                                   **{"queries": None, **sliced}, **rest))
    return kept


def _destinations(backend, rows: list[int], cand: torch.Tensor, own_from: np.ndarray, budget: int):
    """[m, B] slots that receive the kept K/V, and the [k] owned candidate slots to free."""
    n = cand.shape[1]
    if (own_from == own_from[0]).all() and n - own_from[0] >= budget:       # every row owns B candidates or more
        k = int(own_from[0])
        return cand[:, k:k + budget], cand[:, k + budget:].reshape(-1)
    dst, freed = [], []
    for i, row in enumerate(rows):
        owned = cand[i, int(own_from[i]):]
        if owned.numel() >= budget:
            dst.append(owned[:budget])
            freed.append(owned[budget:])
        else:
            extra = take_extras(backend, row, budget - owned.numel())
            backend.state.extras[row] = extra
            dst.append(torch.cat([owned, extra]))
    return torch.stack(dst), (torch.cat(freed) if freed else cand.new_zeros(0))


def _owned_from(backend, rows: np.ndarray, n: int) -> np.ndarray:
    """[m] leading candidates each row does not own: its prompt, shared by the radix tree (scope all, first
    event)."""
    state = backend.state
    if not backend.radix_enabled:
        return np.zeros(len(rows), dtype=np.int64)
    shared = ~state.compressed[rows] & ~state.scope_response[rows]
    return np.where(shared, np.minimum(state.prompt_len[rows], n), 0).astype(np.int64)


def _candidate_positions(state, rows_t, starts_t, first_t, n: int) -> torch.Tensor:
    """[L, m, Hkv, n] logical position of every candidate slot, per layer and KV head: consecutive for a row that
    never compressed (n may exceed B + W), else what its earlier compressions kept."""
    span = starts_t[:, None] + torch.arange(n, device=starts_t.device)                          # [m, n]
    width = state.pos.shape[-1]
    earlier = state.pos[:, rows_t, :, :min(n, width)]                                           # [L, m, Hkv, n]
    if n > width:   # only first compressions (consecutive positions) have more candidates than B + W
        earlier = torch.nn.functional.pad(earlier, (0, n - width))
    return torch.where(first_t[None, :, None, None], span[None, :, None, :].to(earlier.dtype), earlier)


def _zero_range(backend, rows: np.ndarray, n: int, own_from: np.ndarray, budget: int):
    """(rows, columns) of the SGLang row entries this compression zeroes, and the rows' zeroed ranges updated: the
    positions ``[T - f, T)`` (T the logical length, f the freed count): the owned candidates past the kept B at a
    first compression, the tokens appended since the previous one later (so one contiguous range per row)."""
    state = backend.state
    empty = np.zeros(0, np.int64)
    if not backend.config.free_evicted:
        return empty, empty
    count = np.maximum(n - own_from - budget, 0)
    hi = state.logical_len[rows]
    lo = hi - count
    fresh = state.zero_lo[rows] == state.zero_hi[rows]
    if not (fresh | (state.zero_hi[rows] == lo) | (count == 0)).all():
        raise RuntimeError(f"sparse_kv: rows {rows.tolist()} would zero a second range of their SGLang rows")
    state.zero_lo[rows] = np.where(fresh & (count > 0), lo, state.zero_lo[rows])
    state.zero_hi[rows] = np.where(count > 0, hi, state.zero_hi[rows])
    which = np.repeat(np.arange(len(rows)), count)
    cols = np.repeat(lo, count) + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return rows[which], cols


def _give_back(backend, zero_rows: torch.Tensor, zero_cols: torch.Tensor, freed: torch.Tensor) -> None:
    """Return evicted slots to the allocator and zero them in SGLang's rows (its release frees the rest)."""
    if freed.numel() == 0 or not backend.config.free_evicted:
        return
    backend.req_to_token_pool.req_to_token[zero_rows, zero_cols] = 0
    if backend.faults.skip_free:
        return  # fault injection for tests: the slots leave the request but never reach the free list
    backend.allocator.free(freed)


def _update_digests(state, digests: list) -> None:
    """Kept digests of this step's events: one device-to-host copy for all of them."""
    if not digests:
        return
    host = to_host(torch.cat([k.reshape(-1) for _, _, k in digests]))
    offset = 0
    for rows, events, kept in digests:
        size = kept.numel()
        block = host[offset:offset + size].reshape(tuple(kept.shape))              # [L, m, Hkv, B]
        offset += size
        for i, row in enumerate(rows):
            info = state.info[row]
            if info.digest is not None:
                info.digest.update_layers(int(events[i]), block[:, i])
                info.digest_before = info.meta["kept_digest"]
                info.meta["kept_digest"] = info.digest.hexdigest()


def _row_bytes(n: int, heads: int, head_dim: int, itemsize: int) -> int:
    """Transient bytes per row of a chunk besides the scorer: gathered K and V and their float32 copies."""
    return n * heads * head_dim * (2 * itemsize + 8)


def _pair_bytes(cfg, n: int, head_dim: int) -> int:
    """Transient scorer bytes per (row, KV head): R-KV's n x n similarity (float32, its boolean mask, the flipped
    copy) dominates in a pairwise scorer; the window attention is alpha x n per query head of the group."""
    attention = 4 * cfg.window * n * 8
    if cfg.scorer.pairwise:
        return 8 * n * n + attention + 8 * n * head_dim
    return attention + 8 * n * head_dim


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
