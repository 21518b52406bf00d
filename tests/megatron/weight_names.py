"""The HF tensor names of an architecture in the learner's parameter order (the weight-map tests' reference)."""
from __future__ import annotations

from sparse_rl_megatron.models import weight_map as wm
from sparse_rl_megatron.models.arch import ModelArch


def hf_tensor_names(arch: ModelArch) -> list[str]:
    """Every tensor name an HF checkpoint of ``arch`` holds (``lm_head`` only when untied), in Megatron order."""
    names: list[str] = []
    for n in wm.mcore_param_names(arch):
        if n == wm.OUTPUT_LAYER and arch.tie_word_embeddings:
            continue
        names.extend(wm.hf_names(arch, n))
    return names
