"""Micro-batches through megatron-core's pipeline schedule (``get_forward_backward_func``).

The same driver serves the forward-only log-probs and the training step: every stage feeds the same list of
``MicroBatch``es (all stages build them from the same batch, so shapes agree); the last stage hands its
decoder output to ``head_fn(mb, hidden)``. ``variable_seq_lengths`` is on, so micro-batches may differ in
shape and the pipeline exchanges shapes per micro-batch.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from sparse_rl_megatron.learner.batch import MicroBatch
from sparse_rl_megatron.learner.parallel import device
from sparse_rl_megatron.learner import cpu_compat


def _packed_seq_params(mb: MicroBatch, dev: torch.device):
    """THD packing for Transformer Engine attention (GPU): cumulative lengths of the packed blocks."""
    from megatron.core.packed_seq_params import PackedSeqParams

    segments = mb.segments()
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32, device=dev), 0)
    longest = max(segments)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def sequence_parallel_chunk(mask: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """``[b, S]`` -> ``[b, S / tp]``: the positions TP rank ``rank`` holds under sequence parallel (megatron-core
    splits ``[S, b]`` activations along S into ``tp`` contiguous chunks)."""
    if mask.shape[1] % tp:
        raise ValueError(f"sequence parallel needs S = {mask.shape[1]} divisible by TP = {tp}")
    width = mask.shape[1] // tp
    return mask[:, rank * width:(rank + 1) * width]


def model_inputs(mb: MicroBatch, use_thd: bool, routed: bool = False,
                 sp_chunk: tuple[int, int] | None = None) -> dict[str, Any]:
    """Keyword arguments of ``GPTModel.forward`` for ``mb`` on this rank's device. ``routed`` (a mixture of
    experts): with ``mb``'s padding mask, so the routers leave padding out of the load-balancing loss.
    ``sp_chunk = (tp, rank)``: only this TP rank's chunk of the mask (a pipeline stage after the first under
    sequence parallel: megatron-core 0.16 scatters the mask on the first stage only)."""
    dev = device()
    kwargs: dict[str, Any] = dict(input_ids=mb.input_ids.to(dev), position_ids=mb.position_ids.to(dev))
    if routed:
        mask = mb.padding_mask()
        kwargs["padding_mask"] = (mask if sp_chunk is None else sequence_parallel_chunk(mask, *sp_chunk)).to(dev)
    if mb.packed and use_thd:
        kwargs.update(attention_mask=None, packed_seq_params=_packed_seq_params(mb, dev))
    else:
        mask = mb.attention_mask()  # built here, per forward, and only for the local attention
        kwargs["attention_mask"] = None if mask is None else mask.to(dev)
    return kwargs


@cpu_compat.in_device_mode
def run_schedule(
    model,
    micro_batches: list[MicroBatch],
    head_fn: Callable[[MicroBatch, torch.Tensor], Any],
    *,
    forward_only: bool,
    use_thd: bool = False,
    routed: bool = False,
    before_forward: Callable[[Any, MicroBatch], None] | None = None,
) -> list[Any]:
    """Run all micro-batches through the schedule; returns ``head_fn``'s outputs (last stage only; [] elsewhere).

    Forward-only: ``head_fn(mb, hidden)`` returns any data (collected). Training: it returns
    ``(loss_share, metrics)``; the loss is already normalised by the global denominator, so the schedule is
    told ``num_tokens = 0`` (``calculate_per_token_loss`` on: no division by micro-batch count or tokens)
    and gradients are summed over micro-batches and data-parallel ranks. ``routed``: pass each micro-batch's
    padding mask (a mixture of experts; ``model_inputs``). ``before_forward(model, mb)`` runs before each
    micro-batch's forward on every stage (routing replay arms the routers with ``mb``'s experts).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    sp_chunk = None
    if routed and getattr(model, "config", None) is not None and model.config.sequence_parallel \
            and not ps.is_pipeline_first_stage():
        sp_chunk = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())

    def forward_step(data_iterator, mdl):
        mb = next(data_iterator)
        if before_forward is not None:
            before_forward(mdl, mb)
        hidden = mdl(**model_inputs(mb, use_thd, routed, sp_chunk))
        if forward_only:
            return hidden, lambda out, non_loss_data=True: head_fn(mb, out)
        return hidden, partial(_train_loss, head_fn, mb)

    seq = max(mb.input_ids.shape[1] for mb in micro_batches)
    rows = max(mb.input_ids.shape[0] for mb in micro_batches)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq,
        micro_batch_size=rows,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def _train_loss(head_fn, mb: MicroBatch, hidden: torch.Tensor):
    loss, metrics = head_fn(mb, hidden)
    return loss, torch.zeros((), dtype=torch.int, device=loss.device), metrics
