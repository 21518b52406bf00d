"""The reference engine's KV cache: R sequences, per layer and per KV head, compressed in place.

Layout: ``k``/``v`` [L, R, Hkv, capacity, D] (all layers in one tensor, so a compression scores and
gathers every layer at once). Row r holds ``lens[r]`` tokens in slots ``[0, lens[r])``, in original
order, the same count in every layer and head (the budget is uniform), but after a compression each
(layer, head) may hold different tokens: ``pos`` [L, R, Hkv, capacity] records the logical position of
every slot. RoPE is applied before caching with the true positions (``next_pos``),
so the physical slot of a token never matters to attention. Slots ``>= lens[r]`` are stale and masked.

Scoring state kept for the compression package (see ``compression/__init__.py``): the post-RoPE queries
of the last alpha tokens (a ring per layer), H2O's accumulated attention per slot, and TriAttention's online
query centers (per layer, row and query head: the sums of the pre-RoPE queries and of their pair moduli over
every token the row has fed, prompt included).
"""
from __future__ import annotations

import torch

from sparse_rl_megatron.compression import (
    CompressionConfig,
    CompressionSchedule,
    KeptDigest,
    ScoreInputs,
    attention_mass,
    center_sums,
    choose_kept,
    gather_kept,
    get_scorer,
)
from sparse_rl_megatron.compression.scorers import ACCUMULATED_ATTENTION, INPUT_FIELDS, QUERY_CENTERS, QUERY_WINDOW

PROVIDES = frozenset(INPUT_FIELDS)
"""The scorer inputs this cache keeps (every one: the reference engine runs every registered scorer)."""


KEY_ALIGN = 16
"""Attention spans over this cache (prefill width, decode key length) are padded with masked slots to a multiple
of this: CPU attention kernels reduce over keys in SIMD blocks (16 floats with AVX-512) and round a
partial last block differently, so without it a row's log-probs would depend on the longest row it is batched
with (measured: ~1e-6 apart). With it the shapes a row meets vary less, and on some CPUs a row gives the same bits in
any batch; not on every one (MKL / oneDNN choose kernels by shape and instruction set), so the samples of a shard
of a step equal those of the whole step up to float rounding (``tests/unit/test_rollout_engine_shards.py``)."""


def align_keys(length: int) -> int:
    """``length`` rounded up to a multiple of ``KEY_ALIGN``."""
    return -(-length // KEY_ALIGN) * KEY_ALIGN


class CompressedKVCache:
    """K/V (and scoring state) of a batch of sequences; see the module docstring for the layout."""

    def __init__(self, *, num_layers: int, rows: int, num_kv_heads: int, num_q_heads: int, head_dim: int,
                 capacity: int, dtype: torch.dtype, config: CompressionConfig, scaling: float,
                 device: torch.device | str = "cpu", rope_inv_freq: torch.Tensor | None = None,
                 centers: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``rope_inv_freq`` [D / 2] and, for ``triattention_centers=file``, ``centers`` ([L, Hq, D] mean pre-RoPE
        query, [L, Hq, D / 2] mean pair modulus): TriAttention only."""
        self.config = config
        self.schedule = CompressionSchedule(config)
        scorer = get_scorer(config.method)
        if not scorer.runs_with(PROVIDES):
            raise ValueError(f"the HF engine cannot run '{config.method}': it needs {sorted(scorer.needs - PROVIDES)}")
        self.scaling = scaling
        self.num_layers = num_layers
        shape = (num_layers, rows, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        track = self.schedule.enabled
        self.pos = torch.zeros(shape[:4], dtype=torch.long, device=device) if track else None
        self.acc = torch.zeros(shape[:4], dtype=torch.float32, device=device) if ACCUMULATED_ATTENTION in scorer.needs else None
        self.qwin = (torch.zeros(num_layers, rows, num_q_heads, config.window, head_dim, dtype=dtype, device=device)
                     if QUERY_WINDOW in scorer.needs else None)
        self.qptr = 0
        """Ring slot the next query goes to (the oldest); shared by all rows, which decode in lockstep."""
        self.inv_freq = self.centers = self.qsum = self.qabs = self.qcount = None
        if QUERY_CENTERS in scorer.needs:
            if rope_inv_freq is None:
                raise ValueError(f"{config.method} needs the model's rotary inv_freq (rope_inv_freq)")
            self.inv_freq = rope_inv_freq.to(device=device, dtype=torch.float32)
            if config.triattention_centers == "file":
                if centers is None:
                    raise ValueError("triattention_centers=file: the cache needs the loaded centers")
                self.centers = tuple(c.to(device=device, dtype=torch.float32) for c in centers)
            else:
                self.qsum = torch.zeros(num_layers, rows, num_q_heads, head_dim, device=device)
                self.qabs = torch.zeros(num_layers, rows, num_q_heads, head_dim // 2, device=device)
                self.qcount = torch.zeros(num_layers, rows, device=device)
        zeros = lambda: torch.zeros(rows, dtype=torch.long, device=device)  # noqa: E731
        self.lens, self.cand_start, self.next_pos, self.peak, self.events = zeros(), zeros(), zeros(), zeros(), zeros()
        self.digests = [KeptDigest() for _ in range(rows)] if track else None

    @property
    def rows(self) -> int:
        return self.lens.shape[0]

    def _row_index(self, rows: torch.Tensor):
        """``rows`` as an index for dim 1: a plain slice when it is every row in order (no copy on write)."""
        if rows.numel() == self.rows and bool((rows == torch.arange(self.rows, device=rows.device)).all()):
            return slice(None)
        return rows

    # ----------------------------------------------------------------------------------------- prefill
    def prefill_write(self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                      valid: torch.Tensor) -> None:
        """Store a right-padded prompt batch. k, v: [R, Hkv, P, D]; q: [R, Hq, P, D]; valid: [R, P] bool."""
        p = k.shape[2]
        self.k[layer][:, :, :p] = k
        self.v[layer][:, :, :p] = v
        if self.pos is not None:
            self.pos[layer][:, :, :p] = torch.arange(p, device=k.device)
        if self.qwin is not None:
            alpha = self.config.window
            lens = valid.sum(dim=1)
            src = lens[:, None] - alpha + torch.arange(alpha, device=k.device)          # [R, alpha]
            picked = torch.gather(q, 2, src.clamp(min=0)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
            self.qwin[layer].copy_(picked * (src >= 0)[:, None, :, None].to(q.dtype))
        if self.qsum is not None:
            self._add_centers(layer, q, torch.arange(p, device=k.device).expand(q.shape[0], p), valid)
        if self.acc is not None:
            self.acc[layer][:, :, :p] = attention_mass(
                q, k, key_mask=valid, query_mask=valid, causal_offset=0,
                gqa_pooling=self.config.gqa_pooling, scaling=self.scaling)

    def finish_prefill(self, prompt_lens: torch.Tensor) -> None:
        self.lens.copy_(prompt_lens)
        self.next_pos.copy_(prompt_lens)
        self.peak.copy_(prompt_lens)
        self.cand_start.copy_(self.schedule.candidate_start(prompt_lens))
        self.qptr = 0

    def set_response_start(self, prompt_lens: torch.Tensor) -> None:
        """After ``finish_prefill`` of prompts that end in a continued response's tokens: ``prompt_lens`` [R] is
        where each row's response starts (the budget's scope counts the prefilled response tokens as response)."""
        self.cand_start.copy_(self.schedule.candidate_start(prompt_lens))

    # ------------------------------------------------------------------------------------------ decode
    def decode_mask(self) -> torch.Tensor:
        """[R, 1, 1, L] bool: which slots the new token attends (its own slot included); L = max(lens) + 1
        rounded up to ``KEY_ALIGN`` (within the capacity, itself a multiple of it)."""
        length = min(align_keys(int(self.lens.max()) + 1), self.k.shape[3])
        return (torch.arange(length, device=self.lens.device)[None, :] <= self.lens[:, None])[:, None, None, :]

    def decode_write(self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one token per row (k, v: [R, Hkv, 1, D]; q: [R, Hq, 1, D]) at slot ``lens[r]``.

        Returns the K/V views [R, Hkv, L, D] to attend, with L from ``mask`` ([R, 1, 1, L]).
        """
        rows = torch.arange(self.rows, device=k.device)
        self.k[layer][rows, :, self.lens] = k[:, :, 0]
        self.v[layer][rows, :, self.lens] = v[:, :, 0]
        if self.pos is not None:
            self.pos[layer][rows, :, self.lens] = self.next_pos[:, None]
        if self.qwin is not None:
            self.qwin[layer][:, :, self.qptr] = q[:, :, 0]
        if self.qsum is not None:
            self._add_centers(layer, q, self.next_pos[:, None], None)
        length = mask.shape[-1]
        keys, values = self.k[layer][:, :, :length], self.v[layer][:, :, :length]
        if self.acc is not None:
            self.acc[layer][rows, :, self.lens] = 0.0
            self.acc[layer][:, :, :length] += attention_mass(
                q, keys, key_mask=mask[:, 0, 0], gqa_pooling=self.config.gqa_pooling, scaling=self.scaling)
        return keys, values

    def _add_centers(self, layer: int, q: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None) -> None:
        qsum, qabs, count = center_sums(q, positions, self.inv_freq, valid)
        self.qsum[layer] += qsum
        self.qabs[layer] += qabs
        self.qcount[layer] += count

    def _center_inputs(self, r, m: int) -> dict:
        """TriAttention's ScoreInputs fields for rows ``r`` (m of them), flattened [L * m, ...] like the keys."""
        if self.inv_freq is None:
            return {}
        layers = self.num_layers
        if self.centers is not None:
            center, abs_center = (c[:, None].expand(layers, m, *c.shape[1:]) for c in self.centers)
        else:
            count = self.qcount[:, r].clamp_min(1.0)[..., None, None]
            center, abs_center = self.qsum[:, r] / count, self.qabs[:, r] / count
        return dict(query_center=center.reshape(layers * m, *center.shape[2:]),
                    query_abs_center=abs_center.reshape(layers * m, *abs_center.shape[2:]),
                    query_position=self.next_pos[r].repeat(layers), rope_inv_freq=self.inv_freq)

    def finish_decode(self) -> None:
        self.lens += 1
        self.next_pos += 1
        torch.maximum(self.peak, self.lens, out=self.peak)
        if self.qwin is not None:
            self.qptr = (self.qptr + 1) % self.config.window

    # ------------------------------------------------------------------------------------- compression
    @property
    def num_candidates(self) -> torch.Tensor:
        """[R] candidates per row (cached tokens minus the protected prompt for scope=response)."""
        return self.lens - self.cand_start

    def compress(self, rows: torch.Tensor) -> None:
        """Compress the given rows (int64 [m]) down to B candidates in every layer and KV head."""
        budget, window = self.config.budget, self.config.window
        n_cand, start = self.num_candidates, self.cand_start
        pairs = torch.stack([n_cand[rows], start[rows]], dim=1)
        order = (self.qptr + torch.arange(window, device=rows.device)) % window   # oldest window query first
        for n, s0 in torch.unique(pairs, dim=0).tolist():   # rows with the same candidate slots, together
            group = rows[(pairs[:, 0] == n) & (pairs[:, 1] == s0)]
            r = self._row_index(group)
            src, dst = slice(s0, s0 + n), slice(s0, s0 + budget)
            layers, m = self.num_layers, group.numel()
            flat = lambda x: x.reshape(layers * m, *x.shape[2:])  # noqa: E731  [L, m, ...] -> [L*m, ...]
            keys, values = flat(self.k[:, r, :, src]), flat(self.v[:, r, :, src])      # [L*m, Hkv, N, D]
            inputs = ScoreInputs(
                keys=keys, values=values, scaling=self.scaling,
                queries=None if self.qwin is None else flat(self.qwin[:, r][:, :, :, order]),
                accumulated_attention=None if self.acc is None else flat(self.acc[:, r, :, src]),
                **self._center_inputs(r, m),
            )
            kept = choose_kept(self.config, inputs)                                   # [L*m, Hkv, B]
            unflat = lambda x: x.reshape(layers, m, *x.shape[1:])  # noqa: E731
            self.k[:, r, :, dst] = unflat(gather_kept(keys, kept))
            self.v[:, r, :, dst] = unflat(gather_kept(values, kept))
            if self.acc is not None:
                self.acc[:, r, :, dst] = unflat(gather_kept(inputs.accumulated_attention.unsqueeze(-1), kept).squeeze(-1))
            positions = unflat(gather_kept(flat(self.pos[:, r, :, src]).unsqueeze(-1), kept).squeeze(-1))
            self.pos[:, r, :, dst] = positions                                        # [L, m, Hkv, B]
            for i, row in enumerate(group.tolist()):
                self.digests[row].update_layers(int(self.events[row]), positions[:, i])
            self.lens[group] = s0 + budget
            self.events[group] += 1

    def maybe_compress_after_prefill(self) -> None:
        self._compress_where(self.schedule.due_after_prefill(self.num_candidates))

    def maybe_compress_after_decode(self, last_is_newline: torch.Tensor | None = None) -> None:
        """``last_is_newline``: [R] bool, whether the token just appended is a newline (newline trigger)."""
        if self.schedule.enabled:
            self._compress_where(self.schedule.due_after_decode(self.num_candidates, last_is_newline))

    def _compress_where(self, due: torch.Tensor) -> None:
        if bool(due.any()):
            self.compress(torch.nonzero(due).flatten())

    # ------------------------------------------------------------------------------------ row changes
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (or repeat) rows: row i of the result is old row ``index[i]`` (drop finished rows, expand groups)."""
        for name in ("k", "v", "pos", "acc", "qwin", "qsum", "qabs", "qcount"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(1, index))
        for name in ("lens", "cand_start", "next_pos", "peak", "events"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        if self.digests is not None:
            self.digests = [self.digests[i].copy() for i in index.tolist()]
