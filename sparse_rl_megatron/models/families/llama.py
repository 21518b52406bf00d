"""Llama (3.x RoPE scaling included): no biases, RMSNorm, SwiGLU, RoPE, GQA."""
from __future__ import annotations

from sparse_rl_megatron.models.families.spec import FamilySpec, TinyRequest, register_family

# HF Llama's attention_bias puts a bias on o_proj too, which megatron-core can only add together with every other
# linear bias (add_bias_linear); loading it would silently drop o_proj.bias.
O_PROJ_BIAS = "o_proj.bias has no Megatron counterpart"


def _tiny(t: TinyRequest):
    from transformers import LlamaConfig

    return LlamaConfig(**t.common, attention_bias=False, mlp_bias=False)


LLAMA = register_family(FamilySpec(
    name="llama", title="Llama", tiny_config=_tiny,
    refused_flags=(("mlp_bias", ""), ("attention_bias", O_PROJ_BIAS)),
))
