"""The architecture of a decoder-only LM, read from a Hugging Face ``config.json``, per family.

``ModelArch`` holds only what the Megatron model and the weight mapping need. Families are chosen by the
config's ``model_type`` through a registry (``qwen2``, ``llama``, ``qwen3``); anything a family does not
support (sliding windows, RoPE scaling other than Llama 3's, another activation, Llama / Qwen3 MLP or
attention bias, mixture-of-experts models) is refused with the field that says so, rather than converted
into a model that silently computes something else.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

from sparse_rl_megatron.utils.registry import Registry

# Megatron-LM pads the vocabulary to a multiple of this (x TP) so the vocab-parallel matmuls are
# aligned. We keep the multiple independent of TP whenever TP divides it (TP = 1, 2, 4, ..., 128),
# so a torch_dist checkpoint has the same global shapes at every such layout and reshards freely.
DEFAULT_VOCAB_MULTIPLE = 128

# Known model types that are refused, with what is missing for them (checked before the family registry).
UNSUPPORTED_MODEL_TYPES = {
    "qwen3_moe": "Qwen3 MoE needs a mixture-of-experts mapping that does not exist here: the router "
                 "(mlp.gate) and per-expert gate/up/down projections -> megatron-core MoE layers "
                 "(num_moe_experts, moe_router_topk, expert parallelism), and MoE decode in the rollout engine",
    "qwen2_moe": "Qwen2 MoE needs a mixture-of-experts mapping that does not exist here: the router, the "
                 "per-expert and shared-expert projections -> megatron-core MoE layers, and MoE decode in the "
                 "rollout engine",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x RoPE frequency scaling (HF ``rope_type: llama3``): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``original_max_position_embeddings / high_freq_factor`` are kept, the band between is interpolated."""

    factor: float
    """Divisor of the low frequencies (8 in Llama 3.1, 32 in Llama 3.2 1B/3B)."""
    low_freq_factor: float
    """Sets the long-wavelength threshold ``original_max_position_embeddings / low_freq_factor``."""
    high_freq_factor: float
    """Sets the short-wavelength threshold ``original_max_position_embeddings / high_freq_factor``."""
    original_max_position_embeddings: int
    """Context length of pre-training before the extension (8192 in Llama 3.x)."""

    def __post_init__(self) -> None:
        if not (self.factor > 0 and self.low_freq_factor > 0 and self.high_freq_factor > self.low_freq_factor
                and self.original_max_position_embeddings >= 1):
            raise ValueError(f"rope_scaling (llama3) needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                             f"original_max_position_embeddings >= 1; got {self}")


@dataclass(frozen=True)
class ModelArch:
    """Architecture facts of one model (all sizes global, i.e. before tensor parallelism)."""

    family: str
    """Registry name of the family (``qwen2``, ``llama``, ``qwen3``); chosen by the HF ``model_type``."""
    vocab_size: int
    """Rows of the HF embedding (the tokenizer's id space); padded rows are never exposed."""
    hidden_size: int
    """Model width."""
    num_layers: int
    """Transformer layers."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups); equals ``num_attention_heads`` without GQA."""
    head_dim: int
    """Channels per head (``kv_channels`` in Megatron)."""
    ffn_hidden_size: int
    """SwiGLU intermediate size (each of gate and up)."""
    rope_theta: float
    """RoPE base."""
    norm_eps: float
    """RMSNorm epsilon."""
    tie_word_embeddings: bool
    """The LM head reuses the input embedding (Qwen2.5 0.5B-3B)."""
    qkv_bias: bool
    """Q/K/V projections carry a bias (Qwen2); the output projection never does."""
    max_position_embeddings: int
    """Longest sequence the model was configured for."""
    hf_dtype: str = "float32"
    """The dtype the HF checkpoint is stored in (``float32``, ``bfloat16``, ``float16``)."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3); weights ``[head_dim]`` per layer."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.x RoPE scaling; None for plain RoPE."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "head_dim", "ffn_hidden_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelArch.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"ModelArch: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.hf_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"ModelArch.hf_dtype must be float32, bfloat16 or float16, got {self.hf_dtype!r}")

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def padded_vocab_size(self, tp: int, multiple: int = DEFAULT_VOCAB_MULTIPLE) -> int:
        """Embedding rows in the Megatron model: a multiple of ``lcm(multiple, tp)``."""
        step = multiple * tp // math.gcd(multiple, tp)
        return -(-self.vocab_size // step) * step

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a TP size that does not divide the heads, the KV groups or the FFN width."""
        problems = [
            f"{name}={value}" for name, value in (
                ("num_attention_heads", self.num_attention_heads),
                ("num_query_groups (num_key_value_heads)", self.num_query_groups),
                ("ffn_hidden_size (intermediate_size)", self.ffn_hidden_size),
            ) if value % tp
        ]
        if problems:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide {', '.join(problems)} of this {self.family} model; "
                f"valid tensor_parallel_size values divide all of them"
            )

    def tensor_parallel_sizes(self) -> list[int]:
        """TP sizes that divide the heads, the KV groups and the FFN width."""
        common = math.gcd(self.num_attention_heads, self.num_query_groups, self.ffn_hidden_size)
        return [d for d in range(1, common + 1) if common % d == 0]

    def pipeline_parallel_sizes(self) -> list[int]:
        """PP sizes that divide the layers."""
        return [d for d in range(1, self.num_layers + 1) if self.num_layers % d == 0]

    def check_pipeline_parallel(self, pp: int) -> None:
        if self.num_layers % pp:
            raise ValueError(
                f"pipeline_parallel_size={pp} does not divide num_layers={self.num_layers}; "
                f"valid values: {self.pipeline_parallel_sizes()}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArch":
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if isinstance(kwargs.get("rope_scaling"), dict):
            kwargs["rope_scaling"] = RopeScaling(**kwargs["rope_scaling"])
        return cls(**kwargs)

    def differences(self, other: "ModelArch") -> list[str]:
        """``field: self vs other`` for every field that differs (empty when compatible)."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
            for f in fields(self)
            if f.name != "hf_dtype" and getattr(self, f.name) != getattr(other, f.name)
        ]


FAMILIES: Registry[Callable[[dict[str, Any]], ModelArch]] = Registry("model family (HF model_type)")


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of an HF config. transformers >= 5 writes ``rope_parameters`` (rope_type,
    rope_theta and the scaling keys); older configs a top-level ``rope_theta`` and a ``rope_scaling`` dict."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_scaling/rope_parameters.rope_type={rope_type!r} is not supported; valid: default, llama3")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported; valid: 1.0")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"rope_type='llama3' needs rope_scaling/rope_parameters fields {missing}")
    original = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))
    return theta, RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]), int(original))


def _common(cfg: dict[str, Any], family: str, qkv_bias: bool, qk_norm: bool = False) -> ModelArch:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported for {family}; valid: silu")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=True is not supported for {family}; valid: false")
    other_layers = sorted({t for t in cfg.get("layer_types") or [] if t != "full_attention"})
    if other_layers:
        raise ValueError(f"layer_types {other_layers} are not supported for {family}; valid: full_attention")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
    theta, scaling = _rope(cfg)
    return ModelArch(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        rope_theta=theta,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        hf_dtype=dtype,
        qk_norm=qk_norm,
        rope_scaling=scaling,
    )


@FAMILIES.register("qwen2")
def _qwen2(cfg: dict[str, Any]) -> ModelArch:
    """Qwen2 / Qwen2.5: QKV bias, RMSNorm, SwiGLU, RoPE, GQA; tied embeddings on 0.5B-3B."""
    return _common(cfg, "qwen2", qkv_bias=True)


@FAMILIES.register("llama")
def _llama(cfg: dict[str, Any]) -> ModelArch:
    """Llama: no biases, RMSNorm, SwiGLU, RoPE, GQA."""
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported for llama; valid: false")
    # HF Llama's attention_bias puts a bias on o_proj too, which megatron-core can only add together with
    # every other linear bias (add_bias_linear); loading it would silently drop o_proj.bias.
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for llama (o_proj.bias has no Megatron "
                         "counterpart); valid: false")
    return _common(cfg, "llama", qkv_bias=False)


@FAMILIES.register("qwen3")
def _qwen3(cfg: dict[str, Any]) -> ModelArch:
    """Qwen3 dense: like Llama (no biases) plus a per-head RMSNorm on q and k before RoPE; ``head_dim`` is set
    explicitly (128; not hidden / heads on every size); tied embeddings on 0.6B-4B."""
    if cfg.get("attention_bias"):  # HF Qwen3 then also puts a bias on o_proj, as Llama does
        raise ValueError("attention_bias=True is not supported for qwen3 (o_proj.bias has no Megatron "
                         "counterpart); valid: false")
    return _common(cfg, "qwen3", qkv_bias=False, qk_norm=True)


def arch_from_hf_config(cfg: dict[str, Any]) -> ModelArch:
    """Parse an HF config dict (``config.json`` contents); the family comes from ``model_type``."""
    if "model_type" not in cfg:
        raise ValueError(f"HF config has no 'model_type'; valid model types: {', '.join(FAMILIES.names())}")
    if cfg["model_type"] in UNSUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type '{cfg['model_type']}' is not supported: {UNSUPPORTED_MODEL_TYPES[cfg['model_type']]}; "
                         f"valid model types: {', '.join(FAMILIES.names())}")
    return FAMILIES.get(cfg["model_type"])(cfg)


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of an HF checkpoint directory as a dict."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face checkpoint directory")
    return json.loads(path.read_text())
