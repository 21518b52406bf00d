"""Build this pipeline stage's megatron-core ``GPTModel`` for a ``ModelArch``.

The Transformer Engine layer spec is used when TE imports and CUDA is present ("auto"), the local
(pure megatron-core) spec otherwise. The vocabulary is padded to a multiple that TP divides; the true
size is kept on the model (``true_vocab_size``) so log-probs and exports never expose padded rows.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

from sparse_rl_megatron.models.arch import DEFAULT_VOCAB_MULTIPLE, ModelArch
from sparse_rl_megatron.models.megatron_config import transformer_config
from sparse_rl_megatron.models.rope import apply_rope_scaling

from sparse_rl_megatron.utils.registry import Registry
from sparse_rl_megatron.learner import cpu_compat

LAYER_SPECS: Registry[str] = Registry("layer spec")
LAYER_SPECS.add("auto", "Transformer Engine when importable with CUDA, else local")
LAYER_SPECS.add("local", "megatron-core's own modules (runs on CPU)")
LAYER_SPECS.add("te", "Transformer Engine modules (GPU)")


def te_available() -> bool:
    """Transformer Engine importable and a GPU present (TE has no CPU kernels)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def layer_spec(name: str = "auto", qk_layernorm: bool = False):
    """The transformer-layer ``ModuleSpec``: ``te``, ``local``, or ``auto`` (TE when available).
    ``qk_layernorm``: per-head RMSNorm of q and k (Qwen3)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    LAYER_SPECS.check(name, "layer_spec")
    use_te = te_available() if name == "auto" else name == "te"
    if use_te:
        if not te_available():
            raise RuntimeError("layer_spec='te' needs Transformer Engine and a CUDA device; use 'local' or 'auto'")
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)


def _gpt_model_class():
    from megatron.core.models.gpt import GPTModel

    class LearnerGPTModel(GPTModel):
        """``GPTModel`` that can stop before the LM head and return the final hidden states.

        With ``return_hidden=True`` the last stage's forward returns ``[s, b, h]`` (after the final norm);
        ``learner/logprobs.py`` then applies the vocab-parallel head in sequence chunks, so full
        ``[s, b, vocab]`` logits are never built. ``_postprocess`` is the one private megatron-core hook
        used; it receives the decoder output as ``hidden_states`` in 0.16 and later.
        """

        return_hidden: bool = False
        true_vocab_size: int = 0

        def _postprocess(self, hidden_states, *args, **kwargs):
            if self.return_hidden and self.post_process and not self.mtp_process:
                return hidden_states
            return super()._postprocess(hidden_states, *args, **kwargs)

        def output_weight(self):
            """The LM-head weight of this stage (the embedding when tied), ``[padded_vocab / tp, h]``."""
            if self.share_embeddings_and_output_weights:
                return self.shared_embedding_or_output_weight()
            return self.output_layer.weight

    return LearnerGPTModel


@cpu_compat.in_device_mode
def build_stage_model(
    arch: ModelArch,
    *,
    params_dtype: torch.dtype = torch.float32,
    spec: str = "auto",
    vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE,
    overrides: dict[str, Any] | None = None,
):
    """This rank's stage of the model (parallel state must be initialised). Weights are random until loaded."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    config = transformer_config(
        arch, tensor_parallel_size=tp, pipeline_parallel_size=pp, params_dtype=params_dtype, overrides=overrides
    )
    cls = _gpt_model_class()
    model = cls(
        config=config,
        transformer_layer_spec=layer_spec(spec, qk_layernorm=arch.qk_norm),
        vocab_size=arch.padded_vocab_size(tp, vocab_multiple),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )
    apply_rope_scaling(model, arch)
    model.true_vocab_size = arch.vocab_size
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def layer_offset_of(model):
    """local layer index -> global layer index, read from the layers themselves (``layer_number`` is 1-based)."""
    numbers = [layer.layer_number - 1 for layer in unwrap(model).decoder.layers]
    return lambda i: numbers[i]


def unwrap(model):
    """The ``LearnerGPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
