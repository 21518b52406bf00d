"""The model families, one module each (``<name>.py``: its ``FamilySpec``, registered as it is imported), and the
registry they join (``spec``). Every list of model types in the project is read from here.

Adding a family: a module here that registers its spec and its name in the import line below;
``tests/unit/test_model_family_specs.py`` round-trips every registered family (tiny builder -> arch -> weight map).
A tensor no feature maps yet also needs a feature (``spec.FEATURES``, ``weight_map.FEATURE_PARAMS``) and its Megatron
side (``megatron_config``, ``learner.model_provider``).
"""
from sparse_rl_megatron.models.families import llama, qwen2, qwen2_moe, qwen3, qwen3_moe  # noqa: F401  (registers)
from sparse_rl_megatron.models.families.spec import (
    FAMILY_SPECS,
    FEATURES,
    FamilySpec,
    TinyRequest,
    families,
    family_names,
    family_spec,
    register_family,
)

__all__ = ["FAMILY_SPECS", "FEATURES", "FamilySpec", "TinyRequest", "families", "family_names", "family_spec", "register_family"]
