"""RoPE frequency scaling of Llama 3.x (HF ``rope_type: llama3``) on a megatron-core model.

megatron-core's ``RotaryEmbedding`` implements the Llama 3 rule in ``_apply_scaling(freqs, factor,
low_freq_factor, high_freq_factor, original_max_position_embeddings)``, but ``GPTModel(rope_scaling=True)``
passes only ``factor`` and keeps the other three at Llama 3.1's 1 / 4 / 8192. To honour every field of the HF
config, the model is built without scaling and the stage's ``inv_freq`` is replaced by megatron-core's own
``_apply_scaling`` with all four values, before the first forward (the rotary forward is ``lru_cache``d).
The result equals transformers' ``_compute_llama3_parameters`` (same fp32 formula); tests check the logits.
"""
from __future__ import annotations

from sparse_rl_megatron.models.arch import ModelArch


def apply_rope_scaling(model, arch: ModelArch) -> None:
    """Scale the RoPE frequencies of ``model`` (a megatron-core ``GPTModel`` stage) as ``arch`` says; no-op
    for plain RoPE. Must run before the model's first forward."""
    scaling = arch.rope_scaling
    if scaling is None:
        return
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq,
        factor=scaling.factor,
        low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings,
    )
