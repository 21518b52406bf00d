"""Qwen3 dense: like Llama (no biases) plus a per-head RMSNorm on q and k before RoPE; ``head_dim`` is set explicitly
(128; not hidden / heads on every size); tied embeddings on 0.6B-4B."""
from __future__ import annotations

from sparse_rl_megatron.models.families.llama import O_PROJ_BIAS
from sparse_rl_megatron.models.families.spec import FamilySpec, TinyRequest, register_family


def _tiny(t: TinyRequest):
    from transformers import Qwen3Config

    return Qwen3Config(**t.common, head_dim=t.head_dim, attention_bias=False)


# HF Qwen3's attention_bias also puts a bias on o_proj, as Llama's does
QWEN3 = register_family(FamilySpec(name="qwen3", title="Qwen3", tiny_config=_tiny, qk_norm=True,
                                   refused_flags=(("attention_bias", O_PROJ_BIAS),)))
