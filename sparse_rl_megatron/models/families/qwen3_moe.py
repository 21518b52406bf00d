"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3 attention (q/k norms, no biases) and a mixture of experts in every layer, no
shared expert, top-k weights renormalised (``norm_topk_prob``); untied head (SGLang 0.5.23's model never ties it)."""
from __future__ import annotations

from sparse_rl_megatron.models.families.llama import O_PROJ_BIAS
from sparse_rl_megatron.models.families.spec import FamilySpec, TinyRequest, register_family


def _tiny(t: TinyRequest):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**t.common, **t.moe_fields(), head_dim=t.head_dim, attention_bias=False,
                          norm_topk_prob=t.topk_norm(True))


QWEN3_MOE = register_family(FamilySpec(
    name="qwen3_moe", title="Qwen3-MoE", tiny_config=_tiny, qk_norm=True, moe=True,
    refused_flags=(("attention_bias", O_PROJ_BIAS),), sglang_ties_head=False, tiny_tied=False,
    tiny_model_path="tiny-qwen3-moe",
))
