"""``FamilySpec``: everything the project knows about one model family, in one frozen record, and the registry of
them (``FAMILY_SPECS``; ``register_family`` adds one, refusing a name twice; ``family_spec`` looks one up, an unknown
name listing the valid ones).

A family is one HF ``model_type`` (Qwen2 and Qwen2.5 share ``qwen2``). Its spec says:

- how its config becomes a ``ModelArch`` (``models.arch.arch_from_hf_config`` reads the decoder features below, the
  HF field that may switch the QKV bias, and the config flags the family refuses);
- its decoder features (``qkv_bias``, ``qk_norm``, ``moe``, ``shared_expert``): each one is a delta of tensors from a
  plain Llama layer, and ``models.weight_map`` maps every feature's tensors (``weight_map.FEATURE_PARAMS``), so a
  family's weight-map delta is its features (``FamilySpec.features``);
- what SGLang 0.5.23's model of it does (``sglang_ties_head``: it honours ``tie_word_embeddings``; the plugin
  refuses a tied checkpoint of a family whose model does not);
- its tiny builder (``tiny_config``: the HF config of a tiny random model, ``models.tiny``) and the ``model_path``
  of a tiny run of it (``tiny_model_path``: ``trainer.config.TINY_MODELS``).

Imports only the standard library and ``utils.registry``: the SGLang plugin reads it without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sparse_rl_megatron.utils.registry import Registry


@dataclass(frozen=True)
class TinyRequest:
    """What ``models.tiny.tiny_config`` asks a family's tiny builder for: the config fields every family takes
    (``common``) and the sizes only some families read."""

    common: dict[str, Any]
    """vocab, widths, layers, heads, tie_word_embeddings, RoPE, norm eps, special token ids, dtype."""
    head_dim: int
    """Channels per head (families with an explicit ``head_dim`` field: Qwen3, Qwen3-MoE)."""
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool | None
    """None: the family's default."""

    def moe_fields(self) -> dict[str, Any]:
        """The mixture-of-experts config fields of a Qwen MoE config: every layer a mixture of experts."""
        return dict(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                    moe_intermediate_size=self.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
                    output_router_logits=False)

    def topk_norm(self, default: bool) -> bool:
        return default if self.norm_topk_prob is None else self.norm_topk_prob


FEATURES = ("qkv_bias", "qk_norm", "moe", "shared_expert")
"""The decoder features a family may have (``FamilySpec`` fields of these names); ``models.weight_map.FEATURE_PARAMS``
gives the tensors each adds to a plain Llama layer."""


@dataclass(frozen=True)
class FamilySpec:
    """One model family (see the module docstring)."""

    name: str
    """The HF ``model_type`` (``ModelArch.family``, the registry name)."""
    title: str
    """What the family is called in prose (``Qwen2 / Qwen2.5``)."""
    tiny_config: Callable[[TinyRequest], Any]
    """The HF config of a tiny random model of the family (imports transformers when called)."""
    qkv_bias: bool = False
    """Q/K/V projections carry a bias (the output projection never does)."""
    qkv_bias_field: str | None = None
    """The HF config field that may switch ``qkv_bias`` for one checkpoint (Qwen2-MoE's ``qkv_bias``); None: fixed."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE."""
    moe: bool = False
    """Every layer's MLP is a mixture of experts (router + routed experts in place of the dense MLP)."""
    shared_expert: bool = False
    """The mixture of experts adds a shared expert scaled by a sigmoid gate (Qwen2-MoE)."""
    refused_flags: tuple[tuple[str, str], ...] = ()
    """HF config flags that must be false, each with why (empty: no reason given), checked in this order."""
    sglang_ties_head: bool = True
    """SGLang 0.5.23's model of this family honours ``tie_word_embeddings`` (False: it never ties its LM head, so a
    tied checkpoint is refused)."""
    tiny_tied: bool = True
    """A tiny model ties its LM head by default (what the published checkpoints of the small sizes do)."""
    tiny_model_path: str | None = None
    """The training ``model_path`` that builds a tiny random model of this family (None: none offered)."""

    def __post_init__(self) -> None:
        if self.shared_expert and not self.moe:
            raise ValueError(f"family {self.name}: shared_expert needs moe")
        if self.qkv_bias_field is not None and not self.qkv_bias:
            raise ValueError(f"family {self.name}: qkv_bias_field names the switch of a QKV bias it does not have")

    @property
    def features(self) -> frozenset[str]:
        """The decoder features (``FEATURES``) a checkpoint of this family has by default: its weight-map delta."""
        return frozenset(f for f in FEATURES if getattr(self, f))

    def check_flags(self, cfg: dict[str, Any]) -> None:
        """Refuse an HF config that sets one of ``refused_flags``, naming it."""
        for flag, why in self.refused_flags:
            if cfg.get(flag):
                because = f" ({why})" if why else ""
                raise ValueError(f"{flag}=True is not supported for {self.name}{because}; valid: false")

    def has_qkv_bias(self, cfg: dict[str, Any]) -> bool:
        """Whether a checkpoint with HF config ``cfg`` has the QKV bias."""
        return bool(cfg.get(self.qkv_bias_field, self.qkv_bias)) if self.qkv_bias_field else self.qkv_bias


FAMILY_SPECS: Registry[FamilySpec] = Registry("model family (HF model_type)")


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add ``spec`` under its name (a name registered twice is refused); returns it."""
    FAMILY_SPECS.add(spec.name, spec)
    return spec


def family_spec(name: str) -> FamilySpec:
    """The spec of HF ``model_type`` ``name``; an unknown one raises ``UnknownNameError`` listing the valid names."""
    return FAMILY_SPECS.get(name)


def families() -> tuple[FamilySpec, ...]:
    """Every registered family: the dense ones, then the mixtures of experts, each by name."""
    return tuple(sorted((FAMILY_SPECS.get(n) for n in FAMILY_SPECS.names()), key=lambda s: (s.moe, s.name)))


def family_names(**features: bool) -> tuple[str, ...]:
    """The names of the registered families (in ``families()``'s order) whose fields equal ``features``
    (``family_names(moe=True)``: the mixtures of experts)."""
    return tuple(s.name for s in families() if all(getattr(s, k) == v for k, v in features.items()))
