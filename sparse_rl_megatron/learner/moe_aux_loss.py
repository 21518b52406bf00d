"""The load-balancing loss of a mixture of experts, normalised the learner's way, and its metric.

megatron-core's router attaches its Switch load-balancing loss to the routing probabilities (an autograd hook,
``MoEAuxLossAutoScaler``). With ``calculate_per_token_loss`` (which the learner sets) it attaches
``aux_loss x tokens of the micro-batch`` and expects ``finalize_model_grads`` to divide every gradient by the
step's total token count. The learner instead pre-normalises its own loss by the global denominators and tells
the schedule ``num_tokens = 0`` (``learner/forward.py``), so nothing divides: the load-balancing gradient would
come out ``tokens`` times too large. ``LoadBalancingShare`` gives each micro-batch its share
``tokens of the micro-batch / tokens of the whole step`` (over every data-parallel rank) instead, so the attached
loss is, per MoE layer, the token-weighted mean of the micro-batches' load-balancing losses times the coefficient,
whatever the DP size, the micro-batching or the padding. It also sums that mean (without the coefficient) for the
metric ``train/moe_load_balancing_loss`` (averaged over the layers).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist


class LoadBalancingShare:
    """Shared by every router of one model: the step's token count (set before each training step) and the
    load-balancing loss summed as the routers attach it."""

    def __init__(self) -> None:
        self.step_tokens = 0.0
        """Tokens fed through the model in the current optimizer step, summed over the data-parallel ranks."""
        self.total = 0.0
        """Sum over this rank's layers and micro-batches of ``share x load-balancing loss`` (no coefficient)."""

    def start_step(self, step_tokens: float) -> None:
        """Before a training step: its global token count; the running sum restarts."""
        if step_tokens <= 0:
            raise ValueError(f"a training step feeds at least one token, got {step_tokens}")
        self.step_tokens, self.total = float(step_tokens), 0.0

    def share(self, tokens: float | torch.Tensor) -> float | torch.Tensor:
        """The weight of a micro-batch of ``tokens`` tokens in the step's mean."""
        if self.step_tokens <= 0:
            raise RuntimeError("the load-balancing loss was attached outside a training step (start_step not called)")
        return tokens / self.step_tokens

    def record(self, unscaled_loss: torch.Tensor, share: float | torch.Tensor) -> None:
        self.total += float(unscaled_loss.detach().float() * share)


def router_class(share: LoadBalancingShare):
    """megatron-core's ``TopKRouter`` whose load-balancing loss takes ``share``'s weights (see the module
    docstring); a builder for ``MoESubmodules.router`` (called with ``config=`` and ``pg_collection=``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    class LearnerTopKRouter(TopKRouter):
        """``TopKRouter`` with the learner's normalisation of the load-balancing loss."""

        def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                               reduce_group, reduce_group_has_dp=False, valid_token_count=None):
            tokens = activation.shape[0] if valid_token_count is None else valid_token_count
            weight = share.share(tokens)
            share.record(aux_loss / aux_loss_coeff, weight)
            # megatron multiplies the attached loss by valid_token_count under calculate_per_token_loss
            return super().attach_and_log_load_balancing_loss(
                activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                reduce_group_has_dp=reduce_group_has_dp, valid_token_count=weight)

    return functools.partial(LearnerTopKRouter)


def load_balancing_metric(share: LoadBalancingShare, num_layers: int, tp: int, sequence_parallel: bool,
                          device: torch.device) -> float:
    """The step's load-balancing loss per layer (collective over the world; ``device``: where the backend reduces):
    every rank's sum, divided by the TP size when the TP ranks routed the same tokens (no sequence parallel), over
    the layers."""
    total = torch.tensor([share.total], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total) / (1 if sequence_parallel else tp) / num_layers
