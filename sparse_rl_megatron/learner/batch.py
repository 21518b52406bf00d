"""Token sequences for the learner, and how they are cut into micro-batches.

A ``SequenceBatch`` holds B rows of prompt + response token ids. Everything the learner returns per token is
*response-aligned*: ``[B, T]`` with ``T = max response length`` and ``response_mask [B, T]``, the layout of
``sparse_rl_megatron.algo``. Response token j of row i is predicted from the hidden state at position
``P_i - 1 + j`` of the concatenated sequence.

Micro-batches hold at most ``max_tokens`` tokens (a per-device budget): in the ``padded`` layout a
micro-batch costs ``rows x longest row``; in the ``packed`` layout rows are concatenated into one sequence
with a block-diagonal causal mask and cost the sum of their lengths.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from sparse_rl_megatron.utils.registry import Registry

# name -> what a micro-batch costs against the token budget
BATCH_LAYOUTS: Registry[str] = Registry("batch layout")
BATCH_LAYOUTS.add("padded", "rows x longest row (right padding, causal mask)")
BATCH_LAYOUTS.add("packed", "sum of row lengths (one concatenated row, block-diagonal causal mask)")


@dataclass
class SequenceBatch:
    """B rows of ``prompt ++ response`` token ids (1-D long tensors)."""

    prompts: list[torch.Tensor]
    """Prompt token ids per row, ``[P_i]``; ``P_i >= 1`` (the first response token needs a context)."""
    responses: list[torch.Tensor]
    """Response token ids per row, ``[R_i]``; ``R_i >= 0``."""
    routes: list[torch.Tensor] | None = None
    """Mixtures of experts, for routing replay (``learner/routing_replay.py``): per row the sampler's experts of
    every fed token, ``[P_i + R_i - 1, layers, top_k]`` (``Sample.routed_experts``); None: the routers choose."""

    def __post_init__(self) -> None:
        self.prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in self.prompts]
        self.responses = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in self.responses]
        if len(self.prompts) != len(self.responses):
            raise ValueError(f"SequenceBatch: {len(self.prompts)} prompts but {len(self.responses)} responses")
        if not self.prompts:
            raise ValueError("SequenceBatch: empty batch (B == 0)")
        for i, p in enumerate(self.prompts):
            if p.numel() < 1:
                raise ValueError(f"SequenceBatch.prompts[{i}] is empty; every row needs >= 1 prompt token")
        if self.routes is not None:
            if len(self.routes) != len(self.prompts):
                raise ValueError(f"SequenceBatch: {len(self.routes)} routes for {len(self.prompts)} rows")
            for i, (r, n) in enumerate(zip(self.routes, self.lengths)):
                if r.dim() != 3 or r.shape[0] != n:
                    raise ValueError(f"SequenceBatch.routes[{i}] has shape {list(r.shape)}; need [{n}, layers, "
                                     "top_k] (one entry per fed token: prompt + response - 1)")

    @classmethod
    def from_lists(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> "SequenceBatch":
        return cls([torch.tensor(list(p), dtype=torch.long) for p in prompts],
                   [torch.tensor(list(r), dtype=torch.long) for r in responses])

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def lengths(self) -> list[int]:
        """Tokens fed to the model per row: ``P_i + R_i - 1`` (the last token predicts nothing we need),
        or ``P_i`` for an empty response."""
        return [int(p.numel() + max(r.numel() - 1, 0)) for p, r in zip(self.prompts, self.responses)]

    @property
    def max_response_len(self) -> int:
        return max(int(r.numel()) for r in self.responses)

    def response_mask(self) -> torch.Tensor:
        """``[B, T]`` bool, True at real response tokens."""
        lens = torch.tensor([int(r.numel()) for r in self.responses])
        return torch.arange(self.max_response_len).unsqueeze(0) < lens.unsqueeze(1)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids outside ``[0, vocab_size)`` (they would index padded or missing rows)."""
        for i, (p, r) in enumerate(zip(self.prompts, self.responses)):
            ids = torch.cat([p, r])
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise ValueError(
                    f"SequenceBatch row {i}: token ids must be in [0, {vocab_size}), got min {int(ids.min())}, "
                    f"max {int(ids.max())}"
                )


@dataclass
class MicroBatch:
    """Model inputs of one micro-batch and where its log-probs go."""

    rows: list[int]
    """Rows of the ``SequenceBatch`` in this micro-batch."""
    input_ids: torch.Tensor
    """``[b, S]`` long (b = rows when padded, 1 when packed)."""
    position_ids: torch.Tensor
    """``[b, S]`` long (restarting at 0 for every packed row)."""
    seq_lengths: list[int]
    """Fed length of each row, in ``rows`` order (for THD packing on Transformer Engine)."""
    gather_index: torch.Tensor
    """``[n]`` long: flat index into ``[b * S]`` of the positions whose next-token log-prob is needed."""
    labels: torch.Tensor
    """``[n]`` long: the token predicted at each gathered position."""
    out_row: torch.Tensor
    """``[n]`` long: position in ``rows`` of each gathered token."""
    out_col: torch.Tensor
    """``[n]`` long: response index j of each gathered token."""
    packed: bool = False
    """True: the rows are concatenated into one sequence and attend block-diagonally."""
    pad_tokens: int = 0
    """Packed only: padding tokens after the last row (their own block), so S is a multiple of what
    sequence parallel needs; padded micro-batches widen every row instead."""
    padding: bool = False
    """A stand-in run by a data-parallel rank that got no rows (B < DP): it goes through the schedule so the
    rank joins its replica's collectives (gradient all-reduce, parameter gathers), but its outputs are
    discarded and its loss share is exactly 0."""

    @property
    def num_tokens(self) -> int:
        """Tokens fed through the model, padding included (``b x S``)."""
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        """The rows' own tokens, what the load-balancing loss counts: padding excluded, 0 for a stand-in."""
        return 0 if self.padding else sum(self.seq_lengths)

    def padding_mask(self) -> torch.Tensor:
        """``[b, S]`` bool, True at the tokens that are not the rows' own (megatron-core's ``padding_mask``: the
        router leaves them out of its load-balancing statistics): the right-padding of padded rows, the packed
        padding block, every token of a stand-in."""
        if self.padding:
            return torch.ones(self.input_ids.shape, dtype=torch.bool)
        width = self.input_ids.shape[1]
        if self.packed:
            return (torch.arange(width) >= sum(self.seq_lengths)).unsqueeze(0)
        return torch.arange(width).unsqueeze(0) >= torch.tensor(self.seq_lengths).unsqueeze(1)

    def attention_mask(self) -> torch.Tensor | None:
        """None (causal) when padded; when packed the ``[1, 1, S, S]`` bool block-diagonal causal mask
        (True = masked), built on each call: only the local attention reads it (Transformer Engine takes the
        THD row offsets instead), and at 16k tokens it is 256 MiB, so it exists only while a forward uses it."""
        return _block_causal_mask(self.segments()) if self.packed else None

    def segments(self) -> list[int]:
        """Packed only: the blocks of the concatenated sequence, the rows and then the padding (if any)."""
        return list(self.seq_lengths) + ([self.pad_tokens] if self.pad_tokens else [])


def split_rows(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Deal rows to ``parts`` data-parallel ranks, balancing tokens (longest first to the lightest rank).

    Deterministic; rows keep ascending order within a part. With B >= parts every part gets at least one
    row; with fewer rows than parts (a probe, a small evaluation, the last slice of a batch) the first B
    parts get one row each and the others none: the learner runs a padding micro-batch there
    (``padding_micro_batch``), so those ranks still join the replica's collectives.
    """
    if parts < 1:
        raise ValueError(f"cannot split rows over {parts} data-parallel ranks (need DP >= 1)")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for k, i in enumerate(order):
        # the first `parts` rows seed every part, so none stays empty while rows last
        p = k if k < parts else min(range(parts), key=lambda q: (loads[q], q))
        out[p].append(i)
        loads[p] += lengths[i]
    return [sorted(o) for o in out]


def plan_micro_batches(lengths: Sequence[int], rows: Sequence[int], max_tokens: int, layout: str) -> list[list[int]]:
    """Group ``rows`` into micro-batches of at most ``max_tokens`` tokens each.

    ``padded``: rows sorted longest first, a micro-batch grows while ``count x longest <= max_tokens``.
    ``packed``: first-fit decreasing on the sum of lengths. A row longer than the budget gets a micro-batch
    of its own (it cannot be split).
    """
    BATCH_LAYOUTS.check(layout)
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_device must be >= 1, got {max_tokens}")
    order = sorted(rows, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    if layout == "padded":
        for i in order:
            if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups
    loads: list[int] = []
    for i in order:
        for g, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return groups


def _block_causal_mask(lengths: Sequence[int]) -> torch.Tensor:
    total = sum(lengths)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    same = seg.unsqueeze(0) == seg.unsqueeze(1)
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return ~(same & causal).view(1, 1, total, total)


def build_micro_batch(batch: SequenceBatch, rows: Sequence[int], layout: str, pad_id: int = 0,
                      multiple: int = 1) -> MicroBatch:
    """The model inputs and gather plan of ``rows`` in the ``padded`` or ``packed`` layout.

    The sequence length S is padded up to a ``multiple`` (sequence parallel splits S over the TP ranks):
    padded rows get wider, a packed sequence gets a padding block at its end. Padding is never gathered.
    """
    seqs = [torch.cat([batch.prompts[i], batch.responses[i]])[:-1] if batch.responses[i].numel()
            else batch.prompts[i] for i in rows]
    lens = [int(s.numel()) for s in seqs]
    gi, lab, orow, ocol = [], [], [], []
    pad_tokens = 0
    if layout == "padded":
        width = -(-max(lens) // multiple) * multiple
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : lens[r]] = s
        pos = torch.arange(width).unsqueeze(0).expand(len(rows), -1).contiguous()
        starts = [r * width for r in range(len(rows))]
    elif layout == "packed":
        pad_tokens = -sum(lens) % multiple
        ids = torch.cat([*seqs, torch.full((pad_tokens,), pad_id, dtype=torch.long)]).unsqueeze(0)
        pos = torch.cat([torch.arange(n) for n in lens + [pad_tokens]]).unsqueeze(0)
        starts = [sum(lens[:r]) for r in range(len(rows))]
    else:
        BATCH_LAYOUTS.check(layout)
        raise AssertionError(layout)
    for r, i in enumerate(rows):
        p, resp = int(batch.prompts[i].numel()), batch.responses[i]
        n = int(resp.numel())
        gi.append(starts[r] + p - 1 + torch.arange(n))
        lab.append(resp)
        orow.append(torch.full((n,), r, dtype=torch.long))
        ocol.append(torch.arange(n))
    return MicroBatch(
        rows=list(rows), input_ids=ids, position_ids=pos, seq_lengths=lens, gather_index=torch.cat(gi),
        labels=torch.cat(lab), out_row=torch.cat(orow), out_col=torch.cat(ocol), packed=layout == "packed",
        pad_tokens=pad_tokens,
    )


def padding_micro_batch(batch: SequenceBatch, layout: str, pad_id: int = 0, multiple: int = 1) -> MicroBatch:
    """The micro-batch of a data-parallel rank without rows: row 0's inputs, flagged ``padding``."""
    return dataclasses.replace(build_micro_batch(batch, [0], layout, pad_id, multiple), padding=True)
