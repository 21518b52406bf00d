"""Model families on megatron-core: HF config -> ``ModelArch`` -> ``TransformerConfig``, and the HF <-> Megatron
weight mapping; ``tiny``: tiny HF models and a tokenizer built in code (tests, benchmarks, ``model_path: tiny``,
task models). Imports megatron-core lazily (only ``megatron_config`` needs it)."""
from sparse_rl_megatron.models.arch import (
    DEFAULT_VOCAB_MULTIPLE,
    FAMILIES,
    ModelArch,
    arch_from_hf_config,
    read_hf_config,
)

__all__ = ["DEFAULT_VOCAB_MULTIPLE", "FAMILIES", "ModelArch", "arch_from_hf_config", "read_hf_config"]
