"""One optimizer step of the corrected GRPO loss (``sparse_rl_megatron.algo.micro_batch_loss``).

Every rank receives the same global ``TrainBatch``. Rows are dealt to data-parallel ranks (token-balanced),
cut into micro-batches by the per-device token budget and run through the pipeline schedule. The global
normalisers (weight sum, kept tokens, kept sequences, response tokens) are the all-reduced SUM of the
ranks' local parts, so each micro-batch loss is its exact share of the global loss and the summed gradient
does not depend on TP / PP / DP or on the micro-batching.

Non-finite guard: if the loss or any gradient is NaN/inf on any rank, the step is skipped on all ranks
(gradients zeroed, weights, optimizer state and LR schedule unchanged) and counted.

A mixture of experts adds megatron-core's load-balancing loss, weighted by each micro-batch's share of the step's
tokens (the rows' own: padding and stand-in micro-batches count none and are masked out of the routers'
statistics; ``learner/moe_aux_loss.py``), and reports it as ``train/moe_load_balancing_loss``.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparse_rl_megatron.algo import GlobalNormalisers, PreparedBatch, local_normalisers, micro_batch_loss
from sparse_rl_megatron.learner.batch import SequenceBatch
from sparse_rl_megatron.learner.forward import run_schedule
from sparse_rl_megatron.learner.logprobs import to_response_aligned, token_logprobs
from sparse_rl_megatron.learner.optimizer import all_finite
from sparse_rl_megatron.learner.parallel import device
from sparse_rl_megatron.learner import cpu_compat
from sparse_rl_megatron.observability import metric_names as MN


@dataclass
class TrainBatch:
    """A global training batch: token rows plus the algorithm's prepared tensors for the same rows."""

    sequences: SequenceBatch
    """The B rows (prompt + response ids)."""
    prepared: PreparedBatch
    """``prepare_correction`` output, ``[B, T]`` with ``T >= sequences.max_response_len`` (response-aligned)."""
    ref_log_probs: torch.Tensor | None = None
    """``[B, T]`` reference-policy log-probs (needed when the loss has ``kl_coef > 0``)."""

    def __post_init__(self) -> None:
        rows, width = tuple(self.prepared.loss_mask.shape)
        if rows != len(self.sequences) or width < self.sequences.max_response_len:
            raise ValueError(
                f"TrainBatch.prepared has shape [{rows}, {width}], but the sequences need [B, T] with B = "
                f"{len(self.sequences)} and T >= {self.sequences.max_response_len} (the longest response)"
            )
        if self.ref_log_probs is not None and tuple(self.ref_log_probs.shape) != (rows, width):
            raise ValueError(f"TrainBatch.ref_log_probs has shape {tuple(self.ref_log_probs.shape)}, need "
                             f"{[rows, width]} like TrainBatch.prepared")


def _global_normalisers(prepared: PreparedBatch, rows: list[int]) -> GlobalNormalisers:
    from megatron.core import parallel_state as ps

    local = local_normalisers(prepared.loss_mask[rows], prepared.response_mask[rows], prepared.weights[rows])
    t = local.as_tensor(device=device())  # NCCL reduces device tensors only
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return GlobalNormalisers.from_tensor(t.cpu())


def _sum_metrics(per_mb: list[dict], extra_keys: tuple[str, ...] = ()) -> dict[str, float]:
    """SUM the (pre-normalised) micro-batch metrics locally, then over the world; only one TP rank of the last
    stage of each DP replica contributes, so every replica's share counts once."""
    from megatron.core import parallel_state as ps

    contribute = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    local: dict[str, float] = {}
    if contribute:
        for m in per_mb:
            for k, v in m.items():
                local[k] = local.get(k, 0.0) + float(v)
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, local)
    total: dict[str, float] = {}
    for part in gathered:
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v
    return total


@cpu_compat.in_device_mode
def train_step(learner, batch: TrainBatch) -> dict[str, float]:
    """One optimizer step; returns metrics reduced over all ranks (see module docstring)."""
    from megatron.core import parallel_state as ps

    t0 = time.perf_counter()
    cfg = learner.config
    seqs, prepared = batch.sequences, batch.prepared
    seqs.check_vocab(learner.arch.vocab_size)
    lengths = seqs.lengths
    rows = learner.data_parallel_rows(seqs)
    normalisers = _global_normalisers(prepared, rows)
    prepared = dataclasses.replace(prepared, normalisers=normalisers)
    loss_cfg = dataclasses.replace(cfg.loss, check_finite=False)  # non-finite values go to the guard, not raise
    width = prepared.loss_mask.shape[1]
    mbs = learner.micro_batches(seqs)

    def head(mb, hidden):
        lp = to_response_aligned(token_logprobs(learner.model, hidden, mb, cfg.logprob_chunk_tokens), mb, width)
        ref = None if batch.ref_log_probs is None else batch.ref_log_probs[mb.rows].to(lp.device)
        part = prepared.select(mb.rows).to(lp.device)
        if mb.padding:  # a rank without rows: the same computation, every token masked out (loss and grads 0)
            part = part.without_tokens()
        return micro_batch_loss(lp, part, loss_cfg, ref_log_probs=ref)

    model, optimizer, scheduler = learner.ddp, learner.optimizer, learner.scheduler
    balancing = learner.model.load_balancing
    if learner.moe_aux_loss_coeff > 0:
        fed = torch.tensor([float(sum(mb.real_tokens for mb in mbs))], device=device())
        dist.all_reduce(fed, group=ps.get_data_parallel_group())
        balancing.start_step(float(fed))
    model.train()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = run_schedule(model, mbs, head, forward_only=False, use_thd=learner.use_thd,
                           routed=learner.arch.is_moe, before_forward=learner.replayer)
    local_loss = torch.zeros((), dtype=torch.float64)
    for m in outputs:
        local_loss += float(m[MN.LOSS_TOTAL])
    metrics = _sum_metrics(outputs)
    finite = all_finite(model, local_loss)
    grad_norm = float("nan")
    if finite:
        ok, grad_norm, _ = optimizer.step()
        finite = bool(ok)
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    if finite:
        scheduler.step(increment=1)
        learner.steps += 1
    else:
        optimizer.zero_grad()
        model.zero_grad_buffer()
        learner.skipped_steps += 1
    tokens = torch.tensor([float(sum(lengths[i] for i in rows))], device=device())
    dist.all_reduce(tokens, group=ps.get_data_parallel_group())
    if learner.moe_aux_loss_coeff > 0:
        from sparse_rl_megatron.learner.moe_aux_loss import load_balancing_metric

        metrics[MN.TRAIN_MOE_LOAD_BALANCING_LOSS] = load_balancing_metric(
            balancing, learner.arch.num_layers, ps.get_tensor_model_parallel_world_size(),
            bool(learner.model.config.sequence_parallel), device())
    elapsed = time.perf_counter() - t0
    metrics.update({
        MN.TRAIN_GRAD_NORM: grad_norm,
        MN.TRAIN_SKIPPED: 0.0 if finite else 1.0,
        MN.TRAIN_SKIPPED_TOTAL: float(learner.skipped_steps),
        MN.TRAIN_STEP: float(learner.steps),
        MN.TRAIN_LR: float(optimizer.param_groups[0]["lr"]),
        MN.TRAIN_MICRO_BATCHES: float(len(mbs)),
        MN.TRAIN_TOKENS: float(tokens),
        MN.TRAIN_STEP_TIME_S: elapsed,
        MN.TRAIN_TOKENS_PER_S: float(tokens) / elapsed if elapsed > 0 else math.nan,
        MN.TRAIN_KEPT_TOKENS: normalisers.kept_tokens,
        MN.TRAIN_KEPT_SEQS: normalisers.kept_seqs,
    })
    return metrics
