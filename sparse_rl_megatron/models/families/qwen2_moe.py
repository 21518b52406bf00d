"""Qwen1.5 / Qwen2-MoE: Qwen2 attention (QKV bias, switched by the config's ``qkv_bias``) and a mixture of experts in
every layer plus a shared expert gated by ``sigmoid(shared_expert_gate(x))``; top-k weights not renormalised by
default; untied head (SGLang 0.5.23's model never ties it)."""
from __future__ import annotations

from sparse_rl_megatron.models.families.spec import FamilySpec, TinyRequest, register_family


def _tiny(t: TinyRequest):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**t.common, **t.moe_fields(), qkv_bias=True,
                          shared_expert_intermediate_size=t.shared_expert_intermediate_size,
                          norm_topk_prob=t.topk_norm(False))


QWEN2_MOE = register_family(FamilySpec(
    name="qwen2_moe", title="Qwen1.5 / Qwen2-MoE", tiny_config=_tiny, qkv_bias=True, qkv_bias_field="qkv_bias",
    moe=True, shared_expert=True, sglang_ties_head=False, tiny_tied=False, tiny_model_path="tiny-qwen2-moe",
))
