"""Parameters held by one GPU of each pipeline stage, exactly as megatron-core builds them.

Checked against the megatron-core model built on the meta device at every bundled layout
(``tests/megatron/workers/w_meta.py``). A mixture of experts' layer holds its router (whole on every rank), its
``experts / EP`` routed experts split over the expert TP ranks, and Qwen2-MoE's shared expert (split over TP) with
its gate; ``expert_params`` is the routed part, which the distributed optimizer shards over the expert
data-parallel ranks instead of the data-parallel ones.
"""
from __future__ import annotations

from sparse_rl_megatron.models.arch import ModelArch


def _attention_params(arch: ModelArch, tp: int) -> int:
    """Norms, QKV (+ bias, + q/k norms) and the output projection of one layer on one TP rank."""
    h, d = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * d // tp
    n = 2 * h                                   # input_layernorm, pre_mlp_layernorm
    n += qkv_rows * h + (qkv_rows if arch.qkv_bias else 0)
    n += 2 * d if arch.qk_norm else 0           # q_layernorm, k_layernorm (per head, shared)
    n += h * (arch.num_attention_heads * d // tp)  # linear_proj
    return n


def layer_expert_params(arch: ModelArch, ep: int = 1, etp: int = 1) -> int:
    """Routed-expert parameters of one layer on one GPU: ``experts / EP`` SwiGLU experts split over expert TP."""
    if arch.moe is None:
        return 0
    return arch.moe.num_experts // ep * 3 * arch.hidden_size * (arch.moe.ffn_hidden_size // etp)


def layer_params(arch: ModelArch, tp: int, ep: int = 1, etp: int | None = None) -> int:
    """Parameters of one transformer layer on one GPU (norms and the router replicated, projections split)."""
    h = arch.hidden_size
    n = _attention_params(arch, tp)
    if arch.moe is None:
        return n + 3 * h * (arch.ffn_hidden_size // tp)  # linear_fc1 = [gate; up], linear_fc2
    n += arch.moe.num_experts * h                # router
    n += layer_expert_params(arch, ep, tp if etp is None else etp)
    if arch.moe.has_shared_expert:               # shared expert (split over TP) and its [1, h] sigmoid gate
        n += 3 * h * (arch.moe.shared_expert_ffn_hidden_size // tp) + h
    return n


def stage_params(arch: ModelArch, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> list[int]:
    """Parameters on one GPU of each stage ``[stage 0, ..., stage pp - 1]`` (vocab padded; with tied embeddings
    and PP > 1 the last stage holds its own copy of the embedding as LM head)."""
    vocab = arch.padded_vocab_size(tp) // tp * arch.hidden_size
    per_stage = arch.num_layers // pp * layer_params(arch, tp, ep, etp)
    out = []
    for stage in range(pp):
        n = per_stage
        if stage == 0:
            n += vocab                          # embedding
        if stage == pp - 1:
            n += arch.hidden_size               # final norm
            if not (arch.tie_word_embeddings and pp == 1):
                n += vocab                      # output layer (or the tied copy)
        out.append(n)
    return out


def stage_expert_params(arch: ModelArch, pp: int, ep: int = 1, etp: int = 1) -> int:
    """Routed-expert parameters on one GPU of any stage (each stage holds ``layers / PP`` layers)."""
    return arch.num_layers // pp * layer_expert_params(arch, ep, etp)


def total_params(arch: ModelArch) -> int:
    """Parameters of the HF model (vocab unpadded, a tied head counted once; every expert)."""
    heads = 1 if arch.tie_word_embeddings else 2
    return arch.num_layers * layer_params(arch, 1) + heads * arch.vocab_size * arch.hidden_size + arch.hidden_size


def activated_params(arch: ModelArch) -> int:
    """Parameters one token passes through: ``total_params`` with only ``top_k`` of each layer's routed experts
    (the model cards' "activated" count: 3.3B of Qwen3-30B-A3B's 30.5B); a dense model's total."""
    if arch.moe is None:
        return total_params(arch)
    idle = arch.moe.num_experts - arch.moe.top_k
    return total_params(arch) - arch.num_layers * idle * 3 * arch.hidden_size * arch.moe.ffn_hidden_size
