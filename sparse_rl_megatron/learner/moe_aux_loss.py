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
metric ``train/moe_load_balancing_loss`` (averaged over the layers). Padding (the right-padding of padded rows,
the packed padding block, a stand-in micro-batch) is masked out of the routers' statistics and counts no token.

The checkpoint's coefficient (HF ``router_aux_loss_coef``) is defined for ONE loss over all L MoE layers jointly
(transformers' ``load_balancing_loss_func``); megatron-core adds one loss per layer. ``per_layer_coeff`` converts.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def per_layer_coeff(hf_coeff: float, top_k: int, num_layers: int) -> float:
    """megatron-core's per-layer coefficient for the checkpoint's ``router_aux_loss_coef``: ``hf_coeff x top_k / L``.

    For a forward of T tokens (padding excluded), E experts, top-k, and per MoE layer l the top-k assignments
    ``c[l, e]`` to expert e and the softmax scores summed over the tokens ``S[l, e]``:

    - HF (one loss, layers concatenated): ``H = E/(L T)^2 sum_e C_e S_e``, ``C_e = sum_l c[l, e]``,
      ``S_e = sum_l S[l, e]``; k when perfectly balanced.
    - megatron-core (per layer, summed, no division by L): ``M_l = E/(k T^2) sum_e c[l, e] S[l, e]``; 1 balanced.

    The counts carry no gradient, so ``d(coef H)/dS[l, e] = coef E C_e/(L T)^2`` and
    ``d(coeff sum_l M_l)/dS[l, e] = coeff E c[l, e]/(k T^2)``: equal when the layers route alike
    (``c[l, e] = C_e / L``) iff ``coeff = coef k / L``. Then the values obey
    ``coef H = coeff sum_l M_l - coef (E/T^2) sum_e cov_l(c[., e], S[., e])`` (covariance over the layers,
    1/L-normalised): no per-layer sum equals H in general (H multiplies one layer's counts by another's scores),
    and the per-layer one differs from it by the counts' and scores' co-variation across layers. Reusing ``coef`` per
    layer instead weighs the loss and every router's gradient L/k times the checkpoint's (6x for Qwen3-30B-A3B:
    48 layers, top-8; 11.75x for 235B-A22B: 94 layers, top-8)."""
    if num_layers < 1 or top_k < 1:
        raise ValueError(f"per_layer_coeff needs num_layers >= 1 and top_k >= 1, got {num_layers} and {top_k}")
    return hf_coeff * top_k / num_layers


class LoadBalancingShare:
    """Shared by every router of one model: the step's token count (set before each training step) and the
    load-balancing loss summed as the routers attach it."""

    def __init__(self) -> None:
        self.step_tokens = 0.0
        """The rows' own tokens (padding and stand-ins excluded) of the current optimizer step, summed over the
        data-parallel ranks."""
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
    from megatron.core.transformer.moe.moe_utils import (
        get_tokens_per_expert_and_token_count, switch_load_balancing_loss_func,
    )
    from megatron.core.transformer.moe.router import TopKRouter

    class LearnerTopKRouter(TopKRouter):
        """``TopKRouter`` with the learner's normalisation of the load-balancing loss."""

        def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
            """megatron-core 0.16's ``_apply_aux_loss``, but a micro-batch whose tokens are all padding (a
            stand-in) attaches 0: megatron's formula divides by its token count (0/0: NaN loss and gradients)."""
            coeff = self.get_aux_loss_coeff("aux_loss")
            if coeff == 0:
                return probs
            tokens_per_expert, local_tokens, total_tokens = get_tokens_per_expert_and_token_count(
                routing_map=routing_map, reduce_group=self.tp_cp_group, topk=self.topk,
                with_padding_mask=with_padding_mask)
            if with_padding_mask:  # padding has zero counts and scores: the loss is 0 over a clamped count
                total_tokens = total_tokens.clamp(min=1)
            aux_loss = switch_load_balancing_loss_func(
                probs=scores_for_aux_loss, tokens_per_expert=tokens_per_expert, total_num_tokens=total_tokens,
                topk=self.topk, num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
                fused=self.config.moe_router_fusion)
            return self.attach_and_log_load_balancing_loss(
                probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group, valid_token_count=local_tokens)

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
