"""Which KV slots a compressed request owns, and giving them back: the scheduler side of the plugin.

After a row's first compression SGLang's ``req_to_token`` row still says what the row owns, as long as the plugin
keeps one rule: an evicted slot is freed *and* zeroed in the row at the same time (``compaction._give_back``); the
zeroed entries form one contiguous range of positions, ``[zero_lo, zero_hi)`` (``row_state``). So the row's
entries past the tree-owned prefix, minus that range, are exactly its slots, plus the *extras*: slots the plugin
allocated itself for the first compression of a scope ``all`` request whose prompt the radix tree shares (they
appear in the physical table only, ``RowState.extras``). On release the plugin frees exactly those
(``release_row``), SGLang's own release frees nothing twice, and the strict memory checker (idle and busy) sees a
consistent pool (``owned_slots``). All of it is host arithmetic and device slicing: no host sync.
"""
from __future__ import annotations

import torch

from sglang_ext.host_syncs import counted


def _live_spans(backend, row: int, start: int, end: int) -> list[tuple[int, int]]:
    """The parts of SGLang row positions ``[start, end)`` outside the zeroed range."""
    state = backend.state
    lo, hi = int(state.zero_lo[row]), int(state.zero_hi[row])
    if lo >= hi or hi <= start or lo >= end:
        return [(start, end)] if end > start else []
    return [(a, b) for a, b in ((start, lo), (hi, end)) if b > a]


def _extras(backend, row: int) -> list[torch.Tensor]:
    """Slots the row holds that SGLang's row does not list: extras in use, and unused reservations."""
    state = backend.state
    out = []
    if row in state.pending_extras:
        out.append(state.pending_extras[row])
    if row in state.extras and not state.extras_released[row]:
        out.append(state.extras[row])
    return out


def _extent(backend, row: int, kv=None) -> tuple[int, int]:
    """(tree-owned prefix, allocated length) of a row, from SGLang's request record when there is one."""
    info = backend.state.info[row]
    kv = kv if kv is not None else (info.req.kv if info is not None and info.req is not None else None)
    if kv is None:
        return 0, int(backend.state.logical_len[row])
    return int(kv.cache_protected_len), int(kv.kv_allocated_len)


def owned_slots(backend, row: int, kv=None, *, beyond_prompt: bool = False) -> int:
    """Slots the request in ``row`` owns now (SGLang's row past the tree-owned prefix, plus extras);
    ``beyond_prompt``: leave out its prompt (not yet handed to the radix tree, or the tree is off)."""
    protected, allocated = _extent(backend, row, kv)
    if beyond_prompt:
        protected = max(protected, backend.state.info[row].prompt_len)
    listed = sum(b - a for a, b in _live_spans(backend, row, protected, allocated))
    return listed + sum(int(x.numel()) for x in _extras(backend, row))


def handles_row(backend, row: int | None) -> bool:
    """Does releasing ``row`` need the plugin (compressed, or holding reserved slots)?"""
    if backend is None or row is None:
        return False
    state = backend.state
    return bool(state.compressed[row]) or row in state.pending_extras


@counted
def release_row(backend, kv, ranges: list[tuple[int, int]], allocator) -> None:
    """``BasePrefixCache.free_kv_row`` for a compressed row: free the listed ranges' live slots, and once the
    extras; the zeroed range (evicted slots, already freed) is skipped."""
    row = kv.req_pool_idx
    state = backend.state
    rtt = backend.req_to_token_pool.req_to_token
    parts = [rtt[row, a:b].long() for start, end in ranges for a, b in _live_spans(backend, row, start, end)]
    if not state.extras_released[row]:
        parts.extend(x.long() for x in _extras(backend, row))
        state.pending_extras.pop(row, None)
        state.extras.pop(row, None)
        state.extras_released[row] = True
    if parts:
        slots = torch.cat(parts)
        if slots.numel():
            allocator.free(slots)


def extras_needed(backend, req, count_next: int) -> int:
    """Slots the coming forward's compression of ``req`` must allocate (scope all, tree-shared prompt, first
    compression, fewer than B owned candidates); 0 otherwise. ``count_next``: logical length after the forward."""
    row = req.kv.req_pool_idx
    state = backend.state
    info = state.info[row] if row is not None else None
    if info is None or info.config.is_dense or not backend.radix_enabled or state.compressed[row]:
        return 0
    cfg = info.config
    if cfg.scope != "all" or count_next < cfg.max_candidates:
        return 0
    owned = count_next - min(info.prompt_len, count_next)
    return max(cfg.budget - owned, 0) - (0 if row not in state.pending_extras else state.pending_extras[row].numel())


@counted
def reserve_extras(backend, batch) -> None:
    """Scheduler side, right after the decode slots are allocated: reserve the extras of the coming forward's
    first compressions (the tree may be evicted for them, which only the scheduler can do)."""
    from sglang.srt.mem_cache.allocation import alloc_token_slots

    for req in batch.reqs:
        need = extras_needed(backend, req, int(req.kv.kv_committed_len))
        if need > 0:
            row = req.kv.req_pool_idx
            got = alloc_token_slots(batch.tree_cache, need).long()
            held = backend.state.pending_extras.get(row)
            backend.state.pending_extras[row] = got if held is None else torch.cat([held, got])


def take_extras(backend, row: int, count: int) -> torch.Tensor:
    """``count`` slots for a first compression: the scheduler's reservation, else allocated now."""
    state = backend.state
    held = state.pending_extras.pop(row, None)
    if held is not None and held.numel() == count:
        return held
    if held is not None:
        backend.allocator.free(held)
    got = backend.allocator.alloc(count)
    if got is None and backend.tree_cache is not None:
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        evict_from_tree_cache(backend.tree_cache, count)
        got = backend.allocator.alloc(count)
    if got is None:
        raise RuntimeError(
            f"sparse_kv: {count} free KV slots are needed to copy the kept prompt tokens of request row {row} "
            f"out of the shared radix-tree prompt (scope all), and the pool has {backend.allocator.available_size()}; "
            "enlarge the KV pool, lower max_running_requests, or use scope 'response'")
    return got.long()
