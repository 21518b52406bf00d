"""HF <-> megatron-core weight mapping for Qwen2 / Llama / Qwen3 and the Qwen MoE models, per parameter and per
tensor-parallel rank.

Megatron names here are *canonical*: the local-spec names with the **global** layer index
(``decoder.layers.<i>.self_attention.linear_qkv.weight``). The Transformer Engine spec fuses the two
pre-norms into the following linear layers; ``canonical_name`` folds those names back.

How each tensor is laid out in Megatron (source: megatron-core ``SelfAttention.get_query_key_value_tensors``,
``MLP.glu``, ``VocabParallelEmbedding``, ``ColumnParallelLinear``/``RowParallelLinear``):

- ``qkv``: Q, K, V fused along dim 0 *grouped by query group*: for each KV group g,
  ``[q heads of g (heads_per_group * d rows); k_g (d rows); v_g (d rows)]``. TP splits dim 0 contiguously,
  which hands whole groups to each rank (TP must divide the number of groups).
- ``gate_up``: ``linear_fc1`` = ``[gate; up]`` **per TP rank**: rank r holds ``[gate_r; up_r]`` where
  ``gate_r``/``up_r`` are the r-th row chunks (the global tensor is not ``[gate; up]`` split contiguously).
- ``vocab``: the embedding / LM head rows, padded with zero rows to ``padded_vocab`` and split along dim 0.
  The padded rows are stripped on the way back to HF.
- ``column``: split along dim 0; ``row``: split along dim 1 (``linear_proj``, ``linear_fc2``);
  ``replicated``: the same on every TP rank (norm weights, Qwen3's per-head q/k norms of ``[head_dim]``, the MoE
  router ``mlp.router.weight`` ``[experts, h]`` and Qwen2-MoE's shared-expert gate ``[1, h]``).

Mixtures of experts (megatron-core's local ``SequentialMLP``): routed expert ``e`` (its **global** index in the
canonical name) is ``mlp.experts.local_experts.<e>.linear_fc1`` / ``linear_fc2``, laid out like the dense MLP but
split over the *expert* tensor-parallel ranks (``expert_gate_up``, ``expert_row``); which expert-parallel rank
holds it is ``e // (experts / EP)``, and on that rank its local index is ``e % (experts / EP)``
(``canonical_name``'s ``expert_offset``). The shared expert (Qwen2-MoE) is a dense MLP on the attention TP ranks.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping

import torch

from sparse_rl_megatron.models.arch import ModelArch

# Transformer Engine spec name -> local spec name (the inverse of megatron's sharded_state_dict_keys_map).
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# a routed expert's parameter: local spec (SequentialMLP) and Transformer Engine grouped GEMM (TEGroupedMLP) names
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

# per-layer canonical suffix -> (kind, HF suffixes)
_LAYER_PARAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (
        "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
# a mixture-of-experts layer's own parameters (besides the routed experts)
_MOE_PARAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
    "mlp.shared_experts.linear_fc1.weight": (
        "gate_up", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.shared_expert.down_proj.weight",)),
    "mlp.shared_experts.gate_weight": ("replicated", ("mlp.shared_expert_gate.weight",)),
}
_SHARED_EXPERT = tuple(k for k in _MOE_PARAMS if k.startswith("mlp.shared_experts."))
# routed expert suffix -> (kind, HF suffixes with {e} for the expert index)
_EXPERT_PARAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear_fc1.weight": ("expert_gate_up", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    "linear_fc2.weight": ("expert_row", ("mlp.experts.{e}.down_proj.weight",)),
}
FEATURE_PARAMS: dict[str, tuple[str, ...]] = {
    "qkv_bias": ("self_attention.linear_qkv.bias",),
    "qk_norm": _QK_NORMS,
    "moe": ("mlp.router.weight", *(f"mlp.experts.local_experts.{{e}}.{s}" for s in _EXPERT_PARAMS)),
    "shared_expert": _SHARED_EXPERT,
}
"""The canonical per-layer parameters each decoder feature (``FamilySpec.FEATURES``, read off a ``ModelArch`` by
``arch_features``) adds to a plain Llama layer (``{e}``: every routed expert); ``moe`` also drops the dense MLP. A
family's weight-map delta is its features."""
_FEATURE_OF = {suffix: feature for feature, suffixes in FEATURE_PARAMS.items() for suffix in suffixes}
EXPERT_KINDS = ("expert_gate_up", "expert_row")
"""Kinds split over the expert tensor-parallel ranks (and held by one expert-parallel rank)."""
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
HF_EMBED = "model.embed_tokens.weight"
HF_LM_HEAD = "lm_head.weight"


def canonical_name(local_name: str, layer_offset_of: Callable[[int], int] | None = None, expert_offset: int = 0) -> str:
    """A model's parameter name -> canonical name (TE aliases folded, layer and expert indices made global).

    ``layer_offset_of(local_index) -> global_index``; identity when None. ``expert_offset``: the global index of
    this rank's first routed expert (``ep_rank x experts / EP``). A DDP ``module.`` prefix is dropped.
    """
    name = local_name[len("module."):] if local_name.startswith("module.") else local_name
    m = _LAYER.match(name)
    if not m:
        return name
    idx, rest = int(m.group(1)), m.group(2)
    rest = _TE_ALIASES.get(rest, rest)
    grouped = _GROUPED_EXPERT.match(rest)
    if grouped:
        rest = f"mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
    expert = _EXPERT.match(rest)
    if expert:
        rest = f"mlp.experts.local_experts.{int(expert.group(1)) + expert_offset}.{expert.group(2)}"
    if layer_offset_of is not None:
        idx = layer_offset_of(idx)
    return f"decoder.layers.{idx}.{rest}"


def expert_index(name: str) -> int | None:
    """The global routed-expert index of canonical ``name``; None for every other parameter."""
    m = _LAYER.match(name)
    e = _EXPERT.match(m.group(2)) if m else None
    return int(e.group(1)) if e else None


def layer_index(name: str) -> int | None:
    """The global layer index of canonical ``name``; None outside the decoder layers."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def arch_features(arch: ModelArch) -> frozenset[str]:
    """The decoder features (``FEATURE_PARAMS``' keys) ``arch`` has."""
    has = {"qkv_bias": arch.qkv_bias, "qk_norm": arch.qk_norm, "moe": arch.moe is not None,
           "shared_expert": arch.moe is not None and arch.moe.has_shared_expert}
    return frozenset(f for f, on in has.items() if on)


def _layer_suffixes(arch: ModelArch) -> list[str]:
    """Canonical per-layer suffixes of ``arch``, in forward order (routed experts by global index)."""
    features = arch_features(arch)

    def kept(suffix: str) -> bool:
        return _FEATURE_OF.get(suffix) in (None, *features)

    out = [s for s in _LAYER_PARAMS if kept(s) and not (s in _DENSE_MLP and "moe" in features)]
    if arch.moe is not None:
        out += [s for s in _MOE_PARAMS if kept(s)]
        out += [f"mlp.experts.local_experts.{e}.{s}" for e in range(arch.moe.num_experts) for s in _EXPERT_PARAMS]
    return out


def _layer_mapping(rest: str) -> tuple[str, tuple[str, ...]] | None:
    """``(kind, HF suffixes)`` of a per-layer canonical suffix; None when unknown."""
    if rest in _LAYER_PARAMS:
        return _LAYER_PARAMS[rest]
    if rest in _MOE_PARAMS:
        return _MOE_PARAMS[rest]
    e = _EXPERT.match(rest)
    if e:
        kind, hf = _EXPERT_PARAMS[e.group(2)]
        return kind, tuple(h.format(e=int(e.group(1))) for h in hf)
    return None


def mcore_param_names(arch: ModelArch) -> list[str]:
    """Canonical names of every parameter of the whole (unsplit) model, in forward order.

    With tied embeddings the output layer is listed too: at PP > 1 the last stage holds its own copy of
    the embedding (megatron-core keeps the two in sync by summing their grads).
    """
    names = [EMBEDDING]
    suffixes = _layer_suffixes(arch)
    for i in range(arch.num_layers):
        names += [f"decoder.layers.{i}.{suffix}" for suffix in suffixes]
    names += [FINAL_NORM, OUTPUT_LAYER]
    return names


def param_kind(name: str) -> str:
    """How ``name`` (canonical) is split across TP ranks: qkv, gate_up, vocab, column, row, replicated, and for
    routed experts (over the expert TP ranks) expert_gate_up, expert_row."""
    if name in (EMBEDDING, OUTPUT_LAYER):
        return "vocab"
    if name == FINAL_NORM:
        return "replicated"
    m = _LAYER.match(name)
    mapping = _layer_mapping(m.group(2)) if m else None
    if mapping is None:
        raise KeyError(f"no HF mapping for Megatron parameter '{name}'")
    return mapping[0]


def hf_names(arch: ModelArch, name: str) -> tuple[str, ...]:
    """The HF tensor names that ``name`` (canonical) is built from."""
    if name == EMBEDDING:
        return (HF_EMBED,)
    if name == OUTPUT_LAYER:
        return (HF_EMBED,) if arch.tie_word_embeddings else (HF_LM_HEAD,)
    if name == FINAL_NORM:
        return ("model.norm.weight",)
    m = _LAYER.match(name)
    mapping = _layer_mapping(m.group(2)) if m else None
    if mapping is None:
        raise KeyError(f"no HF mapping for Megatron parameter '{name}'")
    return tuple(f"model.layers.{m.group(1)}.{s}" for s in mapping[1])


def _group_qkv(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v ([nh*d, ...], [ng*d, ...], [ng*d, ...]) -> Megatron grouped [(nh + 2 ng) * d, ...]."""
    ng, d, hpg = arch.num_query_groups, arch.head_dim, arch.heads_per_group
    tail = q.shape[1:]
    grouped = torch.cat([q.reshape(ng, hpg * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], dim=1)
    return grouped.reshape(ng * (hpg + 2) * d, *tail)


def _ungroup_qkv(arch: ModelArch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, d, hpg = arch.num_query_groups, arch.head_dim, arch.heads_per_group
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(ng, (hpg + 2) * d, *tail).split([hpg * d, d, d], dim=1)
    return (q.reshape(ng * hpg * d, *tail).contiguous(), k.reshape(ng * d, *tail).contiguous(),
            v.reshape(ng * d, *tail).contiguous())


def hf_to_mcore(
    arch: ModelArch,
    name: str,
    get_hf: Callable[[str], torch.Tensor],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    padded_vocab: int | None = None,
) -> torch.Tensor:
    """The TP shard ``tp_rank`` of Megatron parameter ``name`` (canonical), built from HF tensors.

    ``get_hf(hf_name)`` returns a full HF tensor (lazily read from safetensors, say). For a routed expert
    (``EXPERT_KINDS``) ``tp_rank`` / ``tp_size`` are the expert tensor-parallel rank and size.
    """
    kind = param_kind(name)
    srcs = [get_hf(n) for n in hf_names(arch, name)]
    if kind == "replicated":
        return srcs[0]
    if kind == "qkv":
        return _group_qkv(arch, *srcs).chunk(tp_size, dim=0)[tp_rank]
    if kind in ("gate_up", "expert_gate_up"):
        gate, up = srcs
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    if kind in ("row", "expert_row"):
        return srcs[0].chunk(tp_size, dim=1)[tp_rank]
    if kind == "vocab":
        full = srcs[0]
        padded = padded_vocab or full.shape[0]
        if padded < full.shape[0] or padded % tp_size:
            raise ValueError(f"padded_vocab={padded} must be >= vocab {full.shape[0]} and divisible by TP={tp_size}")
        rows = padded // tp_size
        shard = full.new_zeros((rows, *full.shape[1:]))
        lo, hi = tp_rank * rows, min((tp_rank + 1) * rows, full.shape[0])
        if hi > lo:
            shard[: hi - lo] = full[lo:hi]
        return shard
    raise AssertionError(kind)


def mcore_to_hf(arch: ModelArch, name: str, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors of Megatron parameter ``name`` from its TP shards (in TP-rank order).

    The inverse of ``hf_to_mcore``: ``mcore_to_hf(a, n, [hf_to_mcore(a, n, get, tp_rank=r, tp_size=t) ...])``
    returns the HF tensors bit-identically. Vocab padding is dropped.
    """
    kind = param_kind(name)
    targets = hf_names(arch, name)
    if kind == "replicated":
        return {targets[0]: shards[0]}
    if kind == "qkv":
        return dict(zip(targets, _ungroup_qkv(arch, torch.cat(shards, dim=0))))
    if kind in ("gate_up", "expert_gate_up"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return {targets[0]: torch.cat([h[0] for h in halves], dim=0),
                targets[1]: torch.cat([h[1] for h in halves], dim=0)}
    if kind in ("row", "expert_row"):
        return {targets[0]: torch.cat(shards, dim=1)}
    if kind == "vocab":
        return {targets[0]: torch.cat(shards, dim=0)[: arch.vocab_size]}
    raise AssertionError(kind)


HF_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
"""HF tensors a checkpoint may carry that are not weights: RoPE ``inv_freq`` buffers (older transformers saved them;
they are recomputed from ``rope_theta``). Also ignored: a tied model's ``lm_head.weight`` (the LM head is the
embedding, as transformers ties it on load). Anything else the map does not know is refused (``check_hf_tensors``).
No supported family has multi-token-prediction layers: a checkpoint with them is refused by name."""


def _few(names: list[str], shown: int = 6) -> str:
    """``[a, b, ...]`` and how many more: the first ``shown`` names, then a count."""
    more = f" and {len(names) - shown} more ({len(names)} in all)" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def unexpected_hf_tensors(arch: ModelArch, names: Iterable[str]) -> list[str]:
    """The names of ``names`` that ``arch`` neither maps nor ignores (``HF_IGNORED``, a tied ``lm_head``), sorted."""
    expected = expected_hf_shapes(arch)
    return sorted(n for n in names if n not in expected and not HF_IGNORED.match(n)
                  and not (n == HF_LM_HEAD and arch.tie_word_embeddings))


def check_hf_tensors(arch: ModelArch, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse an HF checkpoint whose tensors do not fit ``arch``: names the missing/unexpected/mismatched ones
    (unexpected: neither mapped nor ``HF_IGNORED``; the conversion would drop them)."""
    expected = expected_hf_shapes(arch)
    missing = sorted(set(expected) - set(shapes))
    unexpected = unexpected_hf_tensors(arch, shapes)
    problems = []
    if missing:
        problems.append(f"missing tensors {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_few(unexpected)} (not weights of this architecture; conversion would "
                        "drop them: check the config, e.g. qkv_bias, tie_word_embeddings, num_hidden_layers)")
    for n, shape in expected.items():
        if n in shapes and tuple(shapes[n]) != shape:
            problems.append(f"{n}: checkpoint shape {tuple(shapes[n])} vs expected {shape}")
    if problems:
        raise ValueError(f"HF checkpoint does not match the {arch.family} architecture: " + "; ".join(problems[:8]))


def expected_hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    h, d, v, f = arch.hidden_size, arch.head_dim, arch.vocab_size, arch.ffn_hidden_size
    nq, nkv = arch.num_attention_heads * d, arch.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {HF_EMBED: (v, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes[HF_LM_HEAD] = (v, h)
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nq, h), "self_attn.k_proj.weight": (nkv, h), "self_attn.v_proj.weight": (nkv, h),
        "self_attn.o_proj.weight": (h, nq),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
    }
    if arch.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if arch.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (nq,), "self_attn.k_proj.bias": (nkv,), "self_attn.v_proj.bias": (nkv,)})
    if arch.moe is not None:
        moe = arch.moe
        for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            del per_layer[k]
        per_layer["mlp.gate.weight"] = (moe.num_experts, h)
        fe = moe.ffn_hidden_size
        for e in range(moe.num_experts):
            per_layer.update({f"mlp.experts.{e}.gate_proj.weight": (fe, h), f"mlp.experts.{e}.up_proj.weight": (fe, h),
                              f"mlp.experts.{e}.down_proj.weight": (h, fe)})
        if moe.has_shared_expert:
            fs = moe.shared_expert_ffn_hidden_size
            per_layer.update({"mlp.shared_expert.gate_proj.weight": (fs, h), "mlp.shared_expert.up_proj.weight": (fs, h),
                              "mlp.shared_expert.down_proj.weight": (h, fs), "mlp.shared_expert_gate.weight": (1, h)})
    for i in range(arch.num_layers):
        for s, shape in per_layer.items():
            shapes[f"model.layers.{i}.{s}"] = shape
    return shapes
