"""Model families on megatron-core: HF config -> ``ModelArch`` -> ``TransformerConfig``, and the HF <-> Megatron
weight mapping; ``families``: one ``FamilySpec`` per model family (the one list of them); ``tiny``: tiny HF models and
a tokenizer built in code (tests, benchmarks, ``model_path: tiny``, task models). Imports megatron-core lazily (only ``megatron_config`` needs it)."""
from sparse_rl_megatron.models.arch import DEFAULT_VOCAB_MULTIPLE, ModelArch, arch_from_hf_config, read_hf_config
from sparse_rl_megatron.models.families import FAMILY_SPECS, FamilySpec, family_spec

__all__ = ["DEFAULT_VOCAB_MULTIPLE", "FAMILY_SPECS", "FamilySpec", "ModelArch", "arch_from_hf_config", "family_spec",
           "read_hf_config"]
