"""The architecture of a decoder-only LM, read from a Hugging Face ``config.json``, per family.

``ModelArch`` holds only what the Megatron model and the weight mapping need. Families are chosen by the
config's ``model_type`` through their registry (``models.families``: each family's ``FamilySpec`` gives its decoder
features and the config flags it refuses); anything a family does not support (sliding windows, RoPE scaling other than
Llama 3's, another activation, Llama / Qwen3 MLP or attention bias, dense layers between MoE layers) is refused
with the field that says so, rather than converted into a model that silently computes something else.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from sparse_rl_megatron.models.families import FAMILY_SPECS, family_spec

# Megatron-LM pads the vocabulary to a multiple of this (x TP) so the vocab-parallel matmuls are
# aligned. We keep the multiple independent of TP whenever TP divides it (TP = 1, 2, 4, ..., 128),
# so a torch_dist checkpoint has the same global shapes at every such layout and reshards freely.
DEFAULT_VOCAB_MULTIPLE = 128



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
class MoEArch:
    """The mixture-of-experts MLP of every layer (Qwen3-MoE, Qwen2-MoE): a softmax router picks ``top_k`` of
    ``num_experts`` SwiGLU experts per token; Qwen2-MoE adds a shared SwiGLU expert scaled by a sigmoid gate."""

    num_experts: int
    """Routed experts per layer (HF ``num_experts``; 128 in Qwen3-30B-A3B)."""
    top_k: int
    """Experts each token is routed to (HF ``num_experts_per_tok``; 8 in Qwen3-30B-A3B)."""
    ffn_hidden_size: int
    """SwiGLU width of one routed expert (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool
    """The top-k routing weights are renormalised to sum to 1 (Qwen3-MoE: true; Qwen1.5/Qwen2-MoE: false)."""
    shared_expert_ffn_hidden_size: int = 0
    """SwiGLU width of the shared expert, 0 for none (HF ``shared_expert_intermediate_size``, Qwen2-MoE); its
    output is scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEArch.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEArch.top_k={self.top_k} (num_experts_per_tok) exceeds num_experts={self.num_experts}")
        if self.shared_expert_ffn_hidden_size < 0:
            raise ValueError(f"MoEArch.shared_expert_ffn_hidden_size must be >= 0, got "
                             f"{self.shared_expert_ffn_hidden_size}")

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_ffn_hidden_size > 0


@dataclass(frozen=True)
class ModelArch:
    """Architecture facts of one model (all sizes global, i.e. before tensor parallelism)."""

    family: str
    """Registry name of the family (``models.families``); chosen by the HF ``model_type``."""
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
    moe: MoEArch | None = None
    """The mixture-of-experts MLP of every layer; None for a dense model (``ffn_hidden_size`` is then the MLP's)."""

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

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def _tp_divided(self) -> tuple[tuple[str, int], ...]:
        """The sizes a (dense) tensor-parallel split divides: heads, KV groups and the MLP width (a mixture of
        experts: the shared expert's width; the routed experts are split by ``expert_tensor_parallel_size``)."""
        sizes = [("num_attention_heads", self.num_attention_heads),
                 ("num_query_groups (num_key_value_heads)", self.num_query_groups)]
        if self.moe is None:
            sizes.append(("ffn_hidden_size (intermediate_size)", self.ffn_hidden_size))
        elif self.moe.has_shared_expert:
            sizes.append(("shared_expert_ffn_hidden_size (shared_expert_intermediate_size)",
                          self.moe.shared_expert_ffn_hidden_size))
        return tuple(sizes)

    def padded_vocab_size(self, tp: int, multiple: int = DEFAULT_VOCAB_MULTIPLE) -> int:
        """Embedding rows in the Megatron model: a multiple of ``lcm(multiple, tp)``."""
        step = multiple * tp // math.gcd(multiple, tp)
        return -(-self.vocab_size // step) * step

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a TP size that does not divide the heads, the KV groups or the FFN width."""
        problems = [f"{name}={value}" for name, value in self._tp_divided() if value % tp]
        if problems:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide {', '.join(problems)} of this {self.family} model; "
                f"valid tensor_parallel_size values divide all of them"
            )

    def tensor_parallel_sizes(self) -> list[int]:
        """TP sizes that divide the heads, the KV groups and the FFN width (see ``check_tensor_parallel``)."""
        common = math.gcd(*(value for _, value in self._tp_divided()))
        return [d for d in range(1, common + 1) if common % d == 0]

    def expert_parallel_sizes(self) -> list[int]:
        """EP sizes that divide the routed experts ([1] for a dense model)."""
        n = self.moe.num_experts if self.moe is not None else 1
        return [d for d in range(1, n + 1) if n % d == 0]

    def expert_tensor_parallel_sizes(self) -> list[int]:
        """Expert-TP sizes that divide a routed expert's width ([1] for a dense model)."""
        f = self.moe.ffn_hidden_size if self.moe is not None else 1
        return [d for d in range(1, f + 1) if f % d == 0]

    def check_expert_parallel(self, ep: int, etp: int) -> None:
        """Refuse an expert-parallel size that does not divide the experts, or an expert-TP size that does not
        divide an expert's width (a dense model takes only EP = expert TP = 1)."""
        if self.moe is None:
            if ep != 1:
                raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model; this {self.family} "
                                 f"model is dense: valid expert_parallel_size values: 1")
            return
        if ep < 1 or self.moe.num_experts % ep:
            raise ValueError(f"expert_parallel_size={ep} does not divide num_experts={self.moe.num_experts} of this "
                             f"{self.family} model; valid expert_parallel_size values: {self.expert_parallel_sizes()}")
        if etp < 1 or self.moe.ffn_hidden_size % etp:
            raise ValueError(f"expert_tensor_parallel_size={etp} does not divide moe_ffn_hidden_size "
                             f"(moe_intermediate_size)={self.moe.ffn_hidden_size} of this {self.family} model; valid "
                             f"expert_tensor_parallel_size values: {self.expert_tensor_parallel_sizes()}")

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
        if isinstance(kwargs.get("moe"), dict):
            kwargs["moe"] = MoEArch(**kwargs["moe"])
        return cls(**kwargs)

    def differences(self, other: "ModelArch") -> list[str]:
        """``field: self vs other`` for every field that differs (empty when compatible)."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
            for f in fields(self)
            if f.name != "hf_dtype" and getattr(self, f.name) != getattr(other, f.name)
        ]


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


def _common(cfg: dict[str, Any], family: str, qkv_bias: bool, qk_norm: bool = False,
            moe: MoEArch | None = None) -> ModelArch:
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
        moe=moe,
    )


def _moe(cfg: dict[str, Any], family: str, shared_expert: bool) -> MoEArch:
    """The ``MoEArch`` of a Qwen MoE config: every layer a mixture of experts (``decoder_sparse_step`` 1, no
    ``mlp_only_layers``, as in Qwen3-30B-A3B / 235B-A22B and Qwen1.5-MoE-A2.7B); anything else is refused."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    if step != 1:
        raise ValueError(f"decoder_sparse_step={step} is not supported for {family} (dense MLP layers between the "
                         f"mixture-of-experts ones); valid: 1")
    if cfg.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers={cfg['mlp_only_layers']} is not supported for {family} (dense MLP "
                         f"layers); valid: []")
    # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts; the hub configs as num_experts
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"the {family} config names no num_experts (or num_local_experts)")
    return MoEArch(
        num_experts=int(experts),
        top_k=int(cfg["num_experts_per_tok"]),
        ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_ffn_hidden_size=int(cfg.get("shared_expert_intermediate_size") or 0) if shared_expert else 0,
    )


def arch_from_hf_config(cfg: dict[str, Any]) -> ModelArch:
    """Parse an HF config dict (``config.json`` contents); the family comes from ``model_type``."""
    if "model_type" not in cfg:
        raise ValueError(f"HF config has no 'model_type'; valid model types: {', '.join(FAMILY_SPECS.names())}")
    spec = family_spec(cfg["model_type"])
    spec.check_flags(cfg)
    return _common(cfg, spec.name, qkv_bias=spec.has_qkv_bias(cfg), qk_norm=spec.qk_norm,
                   moe=_moe(cfg, spec.name, shared_expert=spec.shared_expert) if spec.moe else None)


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of an HF checkpoint directory as a dict."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face checkpoint directory")
    return json.loads(path.read_text())
