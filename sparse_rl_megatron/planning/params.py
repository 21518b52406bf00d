"""Parameters held by one GPU of each pipeline stage, exactly as megatron-core builds them.

Checked against the megatron-core model built on the meta device at every bundled layout
(``tests/megatron/workers/w_meta.py``).
"""
from __future__ import annotations

from sparse_rl_megatron.models.arch import ModelArch


def layer_params(arch: ModelArch, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank (norms replicated, projections split)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * d // tp
    n = 2 * h                                   # input_layernorm, pre_mlp_layernorm
    n += qkv_rows * h + (qkv_rows if arch.qkv_bias else 0)
    n += 2 * d if arch.qk_norm else 0           # q_layernorm, k_layernorm (per head, shared)
    n += h * (arch.num_attention_heads * d // tp)  # linear_proj
    n += 3 * h * (f // tp)                      # linear_fc1 = [gate; up], linear_fc2
    return n


def stage_params(arch: ModelArch, tp: int, pp: int) -> list[int]:
    """Parameters on one GPU of each stage ``[stage 0, ..., stage pp - 1]`` (vocab padded; with tied embeddings
    and PP > 1 the last stage holds its own copy of the embedding as LM head)."""
    vocab = arch.padded_vocab_size(tp) // tp * arch.hidden_size
    per_stage = arch.num_layers // pp * layer_params(arch, tp)
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


def total_params(arch: ModelArch) -> int:
    """Parameters of the HF model (vocab unpadded, a tied head counted once)."""
    heads = 1 if arch.tie_word_embeddings else 2
    return arch.num_layers * layer_params(arch, 1) + heads * arch.vocab_size * arch.hidden_size + arch.hidden_size
