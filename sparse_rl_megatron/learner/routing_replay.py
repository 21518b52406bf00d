"""Routing replay (R3, "Rollout Routing Replay", arXiv:2510.11370): the learner's routers take the sampler's experts.

A mixture of experts routes each token to its top-k experts; the sampler (another kernel, another precision, a
compressed KV cache) and the learner's dense recompute pick different experts for some tokens, and such a token's
log-prob moves by far more than rounding would move it (``mismatch/routing.py`` measures it). With
``learner.moe.routing_replay`` every router of the learner takes the experts the sampler recorded for each fed token
(``Sample.routed_experts`` -> ``SequenceBatch.routes``) in the dense recompute of pi_old and in the training forward;
the routing weights are still the learner's own, computed from its router logits at those experts (softmax over the
k replayed logits when the checkpoint renormalises top-k, the full softmax's values at them otherwise), so the
router keeps its gradient, as R3 defines it. The load-balancing loss still counts the learner's own top-k choices.

Mechanism: megatron-core 0.16's own ``RouterReplay`` (``moe_enable_routing_replay``; its ``REPLAY_FORWARD`` action
gathers the scores at given indices in ``topk_routing_with_score_function``). Before each micro-batch's forward the
routers of this stage get its ``[S x b, top_k]`` indices in megatron-core's token order (sequence-major, the
``[S, b]`` activations flattened; under sequence parallel this TP rank's chunk of S). Positions the sampler never fed
(right padding, a packed row's padding block, a stand-in micro-batch's rows are real rows and get their routes) take
experts ``0..k-1``: their outputs are never scored. Every MoE learner builds the hook (unarmed it is megatron-core's
own top-k); a batch with routes is replayed, one without (the weight-sync probe, ``routing_replay: false``) routes
as usual. ``record_routes`` reads the learner's own choices back (megatron-core's ``RECORD`` action), for
``sparse-rl mismatch``'s engine-vs-learner routing flips. Not with activation recompute at PP > 1 (the 1F1B schedule re-runs a forward after later
micro-batches armed the routers; refused in ``LearnerSettings``), nor with megatron-core's fused router
(``moe_router_fusion``, which bypasses the hook; off, ``models/megatron_config.moe_kernel_settings``).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from sparse_rl_megatron.learner.batch import MicroBatch, SequenceBatch


def micro_batch_routes(batch: "SequenceBatch", mb: "MicroBatch", layers: int, top_k: int,
                       sp_chunk: tuple[int, int] | None = None) -> torch.Tensor:
    """``[S' x b, layers, top_k]`` long: the replayed experts of every position of ``mb`` in megatron-core's token
    order (S' = S, or S / tp for ``sp_chunk = (tp, rank)``); padding positions get experts ``0..top_k - 1``."""
    b, width = mb.input_ids.shape
    out = torch.arange(top_k).expand(b, width, layers, top_k).clone()
    starts = [0] * len(mb.rows) if not mb.packed else [sum(mb.seq_lengths[:r]) for r in range(len(mb.rows))]
    for r, (row, n) in enumerate(zip(mb.rows, mb.seq_lengths)):
        routes = batch.routes[row]
        out[0 if mb.packed else r, starts[r]:starts[r] + n] = routes.long()
    out = out.transpose(0, 1)  # [S, b, L, k]
    if sp_chunk is not None:
        tp, rank = sp_chunk
        chunk = width // tp
        out = out[rank * chunk:(rank + 1) * chunk]
    return out.reshape(-1, layers, top_k)


def _routers(model) -> list[tuple[int, object]]:
    """``(global layer index, RouterReplay)`` of this stage's MoE layers."""
    while hasattr(model, "module"):
        model = model.module
    out = []
    for layer in model.decoder.layers:
        replay = getattr(getattr(getattr(layer, "mlp", None), "router", None), "router_replay", None)
        if replay is not None:
            out.append((layer.layer_number - 1, replay))
    return out


def arm(model, routes: torch.Tensor) -> None:
    """Give every router of ``model``'s stage its layer's experts of ``routes`` (``[tokens, layers, top_k]``) for the
    next forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from sparse_rl_megatron.learner.parallel import device

    for index, replay in _routers(model):
        replay.clear_indices()  # its backward list would grow by one tensor per micro-batch otherwise
        replay.set_target_indices(routes[:, index].to(device()).contiguous())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def disarm(model) -> None:
    """Every router of ``model``'s stage routes by its own top-k again."""
    for _, replay in _routers(model):
        replay.clear_indices()
        replay.clear_router_replay_action()


class Replayer:
    """What ``forward.run_schedule`` arms before each micro-batch: the batch whose routes are replayed."""

    def __init__(self, batch: "SequenceBatch", layers: int, top_k: int, sp_chunk: tuple[int, int] | None):
        self.batch, self.layers, self.top_k, self.sp_chunk = batch, layers, top_k, sp_chunk

    def __call__(self, model, mb: "MicroBatch") -> None:
        arm(model, micro_batch_routes(self.batch, mb, self.layers, self.top_k, self.sp_chunk))


@contextlib.contextmanager
def replaying(model, batch: "SequenceBatch", enabled: bool) -> Iterator[Replayer | None]:
    """A ``Replayer`` of ``batch``'s routes while the block runs (None: ``enabled`` is False or the batch carries no
    routes); the routers are disarmed afterwards, also on an error."""
    if not enabled or batch.routes is None:
        yield None
        return
    from megatron.core import parallel_state as ps

    while hasattr(model, "module"):
        model = model.module
    cfg = model.config
    sp_chunk = ((ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
                if cfg.sequence_parallel else None)
    try:
        yield Replayer(batch, cfg.num_layers, cfg.moe_router_topk, sp_chunk)
    finally:
        disarm(model)


def record_routes(learner, batch: "SequenceBatch") -> list[torch.Tensor]:
    """``Learner.routes``: one forward of ``batch`` with every router recording its top-k; per row the
    ``[P + R - 1, layers, top_k]`` int16 experts of its fed tokens. Collective. PP 1 without sequence parallel (every
    rank holds every router and routes whole sequences)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from sparse_rl_megatron.learner.forward import run_schedule
    from sparse_rl_megatron.learner.parallel import device
    from sparse_rl_megatron.rollout.sample import ROUTE_DTYPE

    cfg = learner.model.config
    if learner.layout.pp > 1 or cfg.sequence_parallel:
        raise ValueError(f"Learner.routes needs pipeline_parallel_size=1 without sequence parallel (got PP "
                         f"{learner.layout.pp}, sequence_parallel={cfg.sequence_parallel}): every rank must hold every "
                         "router and whole sequences")
    routers = _routers(learner.model)
    layers, k = cfg.num_layers, cfg.moe_router_topk
    mbs = learner.micro_batches(batch)
    longest = max(batch.lengths)
    full = torch.zeros(len(batch), longest, layers, k, dtype=torch.long, device=device())

    def arm_record(model, mb) -> None:
        for _, replay in routers:
            replay.clear_indices()
            replay.set_router_replay_action(RouterReplayAction.RECORD)

    def head(mb, hidden):
        b, width = mb.input_ids.shape
        got = torch.stack([replay.get_recorded_indices() for _, replay in routers], dim=1)  # [S * b, L, k]
        return got.view(width, b, layers, k).transpose(0, 1)  # [b, S, L, k]

    try:
        outs = run_schedule(learner.model, mbs, head, forward_only=True, use_thd=learner.use_thd,
                            before_forward=arm_record)
    finally:
        disarm(learner.model)
    if ps.get_tensor_model_parallel_rank() == 0:
        for mb, got in zip(mbs, outs):
            if mb.padding:
                continue
            start = 0
            for r, (row, n) in enumerate(zip(mb.rows, mb.seq_lengths)):
                if mb.packed:
                    full[row, :n] = got[0, start:start + n]
                    start += n
                else:
                    full[row, :n] = got[r, :n]
    dist.all_reduce(full)
    full = full.cpu()
    return [full[i, :n].to(ROUTE_DTYPE) for i, n in enumerate(batch.lengths)]
