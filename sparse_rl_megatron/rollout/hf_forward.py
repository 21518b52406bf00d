"""A hand-written prefill / decode pass over an HF decoder-only model's own modules, on our KV cache.

It calls the model's embedding, norms, projections, rotary embedding, MLPs and LM head directly and
replaces only the attention's cache handling, so the per-row, per-head compressed cache
(``kv_cache.CompressedKVCache``) needs no HF ``Cache`` subclass, and rows of different lengths decode
together with a per-row mask while positions stay logical. Tests check it against ``model.generate`` and a
full forward (fp32, <= 1e-5).

Supported (each checked against ``model.generate`` in the tests): every registered family (``models.families``), all
Llama-style, whose attention is ``q/k/v/o_proj`` + RoPE with full (not sliding) attention in every layer: ``qwen2``,
``llama``, and ``qwen3`` (per-head q/k RMSNorm before RoPE), and the mixtures of experts ``qwen3_moe`` / ``qwen2_moe``.

Mixtures of experts: the MLP is routed here (the model's router weight, softmax, top-k, renormalised when the
config's ``norm_topk_prob`` says so, as transformers does), then the model's own experts (and Qwen2-MoE's gated
shared expert) run. A decode step may *replay* given experts instead of the top-k (``forced_routing``: the
routing weights are then the softmax's at those experts), and the experts each decode step chose are kept
(``last_routing``, and ``prefill_routing`` for every prompt token): ``HFRolloutEngine.teacher_forced`` uses both to
measure what routing adds to the mismatch, and ``generate`` records the sampler's routes for routing replay.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sparse_rl_megatron.models.families import FAMILY_SPECS, family_names, family_spec
from sparse_rl_megatron.rollout.kv_cache import CompressedKVCache

MIN_GEMM_ROWS = 4
"""Linear layers always get at least this many rows (zero rows appended, results dropped): for 1-3 rows CPU
BLAS (MKL) takes a matrix-vector path that rounds differently from its matrix-matrix one, so a row's logits
would depend on how many rows decode with it (measured: ~1e-6). See also ``kv_cache.KEY_ALIGN``."""


def _rows(module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a row-wise module (projection, MLP, norm + head) with at least ``MIN_GEMM_ROWS`` rows."""
    rows = x.numel() // x.shape[-1]
    if rows >= MIN_GEMM_ROWS:
        return module(x)
    flat = x.reshape(rows, x.shape[-1])
    out = module(torch.cat([flat, flat.new_zeros(MIN_GEMM_ROWS - rows, x.shape[-1])]))[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, H, q, D]; cos/sin: [b, q, D] (HF's rotate-half convention)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class HFDecoder:
    """Prefill and decode steps of one HF causal LM over a :class:`CompressedKVCache`."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in FAMILY_SPECS:
            raise ValueError(
                f"HFRolloutEngine: model_type '{model_type}' is not supported; valid: {', '.join(family_names())}"
            )
        spec = family_spec(model_type)
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
            raise ValueError("HFRolloutEngine: sliding-window attention layers are not supported (full attention only)")
        self.model = model
        self.body = model.model
        self.layers = list(self.body.layers[: config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = float(attn.scaling)
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.gqa = self.num_q_heads != self.num_kv_heads
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.inv_freq = self.body.rotary_emb.inv_freq.detach().float()
        """[D / 2] the rotary frequencies (TriAttention un-rotates queries with them)."""
        self.moe = spec.moe
        self.top_k = int(config.num_experts_per_tok) if self.moe else 0
        self.norm_topk_prob = bool(config.norm_topk_prob) if self.moe else False
        self.shared_expert = spec.shared_expert  # Qwen2-MoE: a shared expert scaled by a sigmoid gate
        self.last_routing: torch.Tensor | None = None
        """After a decode step of a mixture of experts: ``[R, layers, top_k]`` long, the experts each row's token
        went to in every layer (the forced ones when replayed); None for a dense model."""
        self.prefill_routing: torch.Tensor | None = None
        """After a prefill of a mixture of experts: ``[R, P, layers, top_k]`` long, the experts every (padded) prompt
        position went to in every layer; None for a dense model."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _qkv(self, attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, q_len, _ = h.shape
        shape = (b, q_len, -1, self.head_dim)
        q = _rows(attn.q_proj, h).view(shape)
        k = _rows(attn.k_proj, h).view(shape)
        if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = _rows(attn.v_proj, h).view(shape).transpose(1, 2)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=self.gqa)
        b, _, q_len, _ = out.shape
        return out.transpose(1, 2).reshape(b, q_len, -1)

    def _mlp(self, layer, h: torch.Tensor, forced: torch.Tensor | None, chosen: list) -> torch.Tensor:
        """The layer's MLP on ``h`` ``[b, s, H]`` (normalised). A mixture of experts is routed here: ``forced``
        ``[b * s, top_k]`` replays those experts; the experts used are appended to ``chosen``."""
        if not self.moe:
            return _rows(layer.mlp, h)
        mlp = layer.mlp
        flat = h.reshape(-1, h.shape[-1])
        logits = _rows(lambda x: F.linear(x, mlp.gate.weight), flat)                # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        if forced is None:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            experts = forced.to(device=probs.device, dtype=torch.long)
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = mlp.experts(flat, experts, weights.to(logits.dtype))
        if self.shared_expert:
            out = out + torch.sigmoid(_rows(mlp.shared_expert_gate, flat)) * _rows(mlp.shared_expert, flat)
        chosen.append(experts)
        return out.reshape(h.shape)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _rows(lambda x: self.model.lm_head(self.body.norm(x)), hidden).float()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor, cache: CompressedKVCache) -> torch.Tensor:
        """Run right-padded prompts. input_ids: [R, P]; prompt_lens: [R]. Returns [R, V] float32 logits of
        each prompt's last token; the cache holds the prompts' K/V (positions 0..P_r-1)."""
        rows, p = input_ids.shape
        device = input_ids.device
        positions = torch.arange(p, device=device).expand(rows, p)
        valid = positions < prompt_lens[:, None]                                       # [R, P]
        causal = torch.ones(p, p, dtype=torch.bool, device=device).tril()
        mask = (causal[None] & valid[:, None, :])[:, None]                             # [R, 1, P, P]
        x = self.body.embed_tokens(input_ids)
        cos, sin = self.body.rotary_emb(x, positions)
        chosen: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)
            cache.prefill_write(i, k, v, q, valid)
            x = x + _rows(attn.o_proj, self._attend(q, k, v, mask))
            x = x + self._mlp(layer, layer.post_attention_layernorm(x), None, chosen)
        cache.finish_prefill(prompt_lens)
        self.prefill_routing = torch.stack(chosen, dim=1).view(rows, p, len(chosen), -1) if chosen else None
        last = x[torch.arange(rows, device=device), prompt_lens - 1]
        return self._logits(last)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: CompressedKVCache,
               forced_routing: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per row (tokens: [R]) at its logical position. Returns [R, V] float32 logits.
        ``forced_routing`` (mixtures of experts): ``[R, layers, top_k]`` experts to use instead of the router's."""
        if forced_routing is not None and not self.moe:
            raise ValueError("HFDecoder.decode: forced_routing given but the model is not a mixture of experts")
        positions = cache.next_pos[:, None]
        x = self.body.embed_tokens(tokens[:, None])
        cos, sin = self.body.rotary_emb(x, positions)
        mask = cache.decode_mask()
        chosen: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)
            keys, values = cache.decode_write(i, k, v, q, mask)
            x = x + _rows(attn.o_proj, self._attend(q, keys, values, mask))
            forced = None if forced_routing is None else forced_routing[:, i]
            x = x + self._mlp(layer, layer.post_attention_layernorm(x), forced, chosen)
        cache.finish_decode()
        self.last_routing = torch.stack(chosen, dim=1) if chosen else None
        return self._logits(x[:, 0])
