"""Qwen2 / Qwen2.5: QKV bias, RMSNorm, SwiGLU, RoPE, GQA; tied embeddings on 0.5B-3B."""
from __future__ import annotations

from sparse_rl_megatron.models.families.spec import FamilySpec, TinyRequest, register_family


def _tiny(t: TinyRequest):
    from transformers import Qwen2Config

    return Qwen2Config(**t.common)


QWEN2 = register_family(FamilySpec(name="qwen2", title="Qwen2 / Qwen2.5", tiny_config=_tiny, qkv_bias=True,
                                   tiny_model_path="tiny"))
