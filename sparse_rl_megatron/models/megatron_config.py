"""``ModelArch`` -> megatron-core ``TransformerConfig`` (Qwen2, Llama and Qwen3 share one mapping).

All families are pre-norm decoders with RMSNorm, SwiGLU (``gated_linear_unit`` + SiLU, fc1 = [gate; up]),
RoPE (non-interleaved, like HF's ``rotate_half``), GQA, no linear biases except Qwen2's Q/K/V bias; Qwen3
adds a per-head RMSNorm of q and k (``qk_layernorm``; the layer spec must be built with it too).

Mixtures of experts (``ModelArch.moe``) get megatron-core's MoE layer in every layer (``moe_config``): a softmax
top-k router (renormalised top-k = softmax over the k selected logits, ``moe_router_pre_softmax=False``;
not renormalised = top-k of the full softmax, ``True``), SwiGLU experts of ``moe_ffn_hidden_size``, Qwen2-MoE's
sigmoid-gated shared expert, the experts' kernels of ``moe_kernel_settings`` (Transformer Engine's grouped GEMM on a
GPU with TE, one GEMM per local expert otherwise), the ``alltoall`` token dispatcher, no capacity limit (no token is ever dropped, so a
token's output does not depend on the other tokens of its batch), the Switch load-balancing loss.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.utils.device import cuda_present

# Fused CUDA kernels that have no CPU implementation; off whenever CUDA is absent.
_CPU_UNFUSED = dict(
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    use_cpu_initialization=True,
)
FUSION_SWITCHES = tuple(k for k in _CPU_UNFUSED if k != "use_cpu_initialization")
# The local spec's attention softmax kernels (apex's megatron extensions); Transformer Engine attention has its own.
_SOFTMAX_KERNELS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")


def fusion_settings(cuda: bool) -> dict[str, bool]:
    """megatron-core's fusion switches for these models (RMSNorm, SwiGLU, RoPE, no linear bias but Qwen2's
    Q/K/V bias). megatron-core 0.16.1 leaves them all off by default; on CUDA the learner turns on each one
    megatron-core can run here, decided from megatron-core's own availability flags:

    - ``bias_activation_fusion``: on (fused SwiGLU, ``bias_swiglu_impl``; a missing bias is allowed; jit fuser).
    - ``bias_dropout_fusion``: on (fused bias-dropout-add of the residual; jit fuser).
    - ``apply_rope_fusion``: on when megatron-core found Transformer Engine's fused RoPE kernel (it refuses the
      switch otherwise).
    - ``gradient_accumulation_fusion``: on when apex's ``fused_weight_gradient_mlp_cuda`` imports (megatron's
      own ``ColumnParallelLinear``, the LM head even under the TE spec, refuses the switch otherwise).
    - ``masked_softmax_fusion``: on when apex's softmax kernels import (the local spec's attention; TE's
      attention does not use it; megatron falls back per shape on its own).
    - ``persist_layer_norm``: off (apex's persistent kernel is LayerNorm only; these models use RMSNorm).

    On CPU every switch is off (no CPU kernels) and parameters are initialised on the CPU.
    """
    if not cuda:
        return dict(_CPU_UNFUSED)
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    return dict(
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        apply_rope_fusion=rope_utils.fused_apply_rotary_pos_emb is not None,
        gradient_accumulation_fusion=bool(layers._grad_accum_fusion_available),
        masked_softmax_fusion=all(importlib.util.find_spec(m) is not None for m in _SOFTMAX_KERNELS),
        persist_layer_norm=False,
    )


# megatron-core's router_dtype values for the learner's ``moe.router_dtype`` names ("params": the input's dtype)
_ROUTER_DTYPES = {"params": None, "fp32": "fp32"}


# the fused permutation kernels megatron-core's token dispatcher calls when moe_permute_fusion is on (TE >= 2.1)
_PERMUTE_KERNELS = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                    "fused_sort_chunks_by_index_with_probs", "fused_unpermute")


def moe_kernel_settings(grouped_gemm: bool) -> dict[str, bool]:
    """megatron-core's MoE kernel switches for the experts' path (``learner.model_provider.resolve_expert_kernels``):

    - ``moe_grouped_gemm``: ``grouped_gemm`` (True: Transformer Engine's ``TEGroupedMLP``, all local experts in one
      grouped GEMM per matrix; False: ``SequentialMLP``, one GEMM per local expert after the other).
    - ``moe_permute_fusion``: with grouped GEMM, on when megatron-core found TE's fused permutation kernels (its own
      import flags; it refuses the switch otherwise); the token order, and so every result, is the unfused one's.
    - ``moe_router_fusion``: off. TE's fused top-k computes the routing without megatron-core's ``RouterReplay``
      hook (``learner.moe.routing_replay`` would be ignored) and has not been compared with the engines' routers.
    """
    permute = False
    if grouped_gemm:
        from megatron.core.transformer.moe import moe_utils

        permute = bool(moe_utils.HAVE_TE) and all(getattr(moe_utils, k, None) is not None for k in _PERMUTE_KERNELS)
    return dict(moe_grouped_gemm=bool(grouped_gemm), moe_permute_fusion=permute, moe_router_fusion=False)


def moe_config(arch: ModelArch, *, expert_parallel_size: int = 1, expert_tensor_parallel_size: int = 1,
               aux_loss_coeff: float = 0.0, router_dtype: str = "params", grouped_gemm: bool = False,
               routing_replay: bool = False) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``arch``'s mixture of experts (empty for a dense model). ``grouped_gemm``:
    the experts' kernels (``moe_kernel_settings``); ``routing_replay``: every router gets megatron-core's
    ``RouterReplay`` (``learner/routing_replay.py`` feeds it the sampler's experts)."""
    if arch.moe is None:
        return {}
    arch.check_expert_parallel(expert_parallel_size, expert_tensor_parallel_size)
    if router_dtype not in _ROUTER_DTYPES:
        raise ValueError(f"router_dtype={router_dtype!r}; valid: {', '.join(_ROUTER_DTYPES)}")
    moe = arch.moe
    if moe.top_k == 1 and moe.norm_topk_prob:
        raise ValueError("num_experts_per_tok=1 with norm_topk_prob=true (every token's one expert weighted 1) has no "
                         "megatron-core router: it takes top-1 only after a softmax over all experts "
                         "(moe_router_pre_softmax), which weights the expert by its probability; valid: "
                         "num_experts_per_tok >= 2, or norm_topk_prob=false")
    fields = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(aux_loss_coeff),
        moe_router_dtype=_ROUTER_DTYPES[router_dtype],
        moe_token_dispatcher_type="alltoall",
        moe_enable_routing_replay=bool(routing_replay),
        expert_model_parallel_size=expert_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        **moe_kernel_settings(grouped_gemm),
    )
    if moe.has_shared_expert:
        fields.update(moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
                      moe_shared_expert_gate=True, moe_shared_expert_overlap=False)
    return fields


def transformer_config(
    arch: ModelArch,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
    cuda: bool | None = None,
    moe: dict[str, Any] | None = None,
):
    """The megatron-core ``TransformerConfig`` for ``arch`` at a TP x PP layout.

    Fusions follow ``fusion_settings(cuda)`` (``cuda``: the learner's device has CUDA; None: this machine's
    ``cuda_present()``). ``overrides`` are set last (any ``TransformerConfig`` field, e.g.
    ``recompute_granularity``, or a fusion switch); an unknown field name is refused with the list of valid
    ones. ``moe``: the keyword arguments of ``moe_config`` (expert layout, load-balancing coefficient, router
    dtype) for a mixture of experts. Dropout is 0 (RL fine-tuning; also what makes the
    dense log-probs deterministic). ``calculate_per_token_loss`` is on because the learner pre-normalises
    every micro-batch loss by the global denominator (see ``learner/train_step.py``).
    """
    from megatron.core.transformer import TransformerConfig

    arch.check_tensor_parallel(tensor_parallel_size)
    arch.check_pipeline_parallel(pipeline_parallel_size)
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Each micro-batch may have its own length (dynamic batching); the PP schedule then exchanges shapes.
        variable_seq_lengths=True,
        # Config validation rejects variable_seq_lengths with the default "allgather" dispatcher even for
        # dense models (no experts are built either way).
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True,
        sequence_parallel=False,
        # The whole-layer scope in megatron-core 0.16's current spelling; its default "full" means the same
        # thing but warns that it is deprecated on every model build.
        cuda_graph_scope=[],
    )
    kwargs.update(moe_config(arch, **(moe or {})))
    kwargs.update(fusion_settings(cuda_present() if cuda is None else cuda))
    valid = {f.name for f in dataclasses.fields(TransformerConfig)}
    for key in overrides or {}:
        if key not in valid:
            raise ValueError(
                f"megatron override '{key}' is not a TransformerConfig field; valid fields include: "
                f"{', '.join(sorted(valid)[:40])}, ... (see megatron/core/transformer/transformer_config.py)"
            )
    kwargs.update(overrides or {})
    return TransformerConfig(**kwargs)
