"""Attention-derived token scores: SnapKV-style window importance, and H2O's accumulated attention mass.

Inputs are post-RoPE queries and keys, exactly as both engines hold them (HF's cache and SGLang's KV pool
store keys after the rotary embedding). Everything is computed in float32 whatever the cache dtype, so
two engines holding the same tensors rank tokens identically.

Sources: SnapKV (Li et al., 2024, arXiv 2404.14469) observation-window voting with max pooling; the
R-KV reference code (Cai et al., 2025, arXiv 2505.24133) for the GQA pooling of logits (max over the
query heads of a group) and for normalising the softmax over the keys before the window only;
H2O (Zhang et al., 2023, arXiv 2306.14048) for accumulated attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _group_queries(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, Hq, q, D] -> [n, Hkv, G, q, D] with G = Hq / Hkv (query head h belongs to KV head h // G)."""
    n, hq, q, d = queries.shape
    if hq % num_kv_heads:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({num_kv_heads})")
    return queries.reshape(n, num_kv_heads, hq // num_kv_heads, q, d)


def _pool_groups(x: torch.Tensor, gqa_pooling: str) -> torch.Tensor:
    """Pool dim 2 (the query heads of a GQA group)."""
    if gqa_pooling == "max":
        return x.amax(dim=2)
    if gqa_pooling == "mean":
        return x.mean(dim=2)
    raise ValueError(f"gqa_pooling must be one of max, mean; got '{gqa_pooling}'")


def window_importance(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    window: int,
    pool_kernel: int = 7,
    gqa_pooling: str = "max",
    scaling: float | None = None,
) -> torch.Tensor:
    """How much the observation window attends to each older token.

    ``softmax(q_win K_past^T * scaling)`` over the ``N - alpha`` keys before the window (the window's own
    keys are left out of the normalisation, as in R-KV), GQA logits pooled over each group's query heads,
    mean over the alpha window queries, then max-pooled along the sequence (kernel k, stride 1, padding k//2).

    Args:
        queries: [n, Hq, alpha, D] post-RoPE queries of the last alpha tokens, oldest first.
        keys: [n, Hkv, N, D] post-RoPE keys of the N candidates, oldest first; the last alpha are the window.
        window: alpha.
        scaling: softmax scale (default ``D ** -0.5``).
    Returns:
        [n, Hkv, N - alpha] float32.
    """
    n, hkv, length, d = keys.shape
    if queries.shape[2] != window:
        raise ValueError(f"window_importance needs exactly window={window} queries; got {queries.shape[2]}")
    if length <= window:
        raise ValueError(f"window_importance needs more keys ({length}) than the window ({window})")
    scale = d ** -0.5 if scaling is None else scaling
    q = _group_queries(queries.float(), hkv)                                # [n, Hkv, G, a, D]
    past = keys[:, :, : length - window].float().unsqueeze(2)               # [n, Hkv, 1, N-a, D]
    logits = torch.matmul(q, past.transpose(-1, -2)) * scale                # [n, Hkv, G, a, N-a]
    logits = _pool_groups(logits, gqa_pooling)                              # [n, Hkv, a, N-a]
    votes = torch.softmax(logits, dim=-1).mean(dim=-2)                      # [n, Hkv, N-a]
    if pool_kernel > 1:
        votes = F.max_pool1d(votes, kernel_size=pool_kernel, stride=1, padding=pool_kernel // 2)
    return votes


def attention_mass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    key_mask: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
    causal_offset: int | None = None,
    gqa_pooling: str = "max",
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention probability each key receives, summed over the given queries (H2O's accumulator increment).

    Probabilities are the model's own (softmax over every visible key, per query head); the query heads of a
    GQA group are pooled with ``gqa_pooling`` after the softmax.

    Args:
        queries: [n, Hq, q, D] post-RoPE queries.
        keys: [n, Hkv, S, D] post-RoPE keys (all retained tokens, physical order).
        key_mask: optional [n, S] bool, True where a key slot holds a token (padding excluded).
        query_mask: optional [n, q] bool, True for real queries (padded queries contribute nothing).
        causal_offset: if given, query i may only see keys ``j <= causal_offset + i`` (prefill); None = all.
    Returns:
        [n, Hkv, S] float32; zero on masked slots.
    """
    n, hkv, s, d = keys.shape
    scale = d ** -0.5 if scaling is None else scaling
    q = _group_queries(queries.float(), hkv)                                # [n, Hkv, G, q, D]
    logits = torch.matmul(q, keys.float().unsqueeze(2).transpose(-1, -2)) * scale  # [n, Hkv, G, q, S]
    visible = torch.ones(n, 1, 1, q.shape[3], s, dtype=torch.bool, device=keys.device)
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, None, :]
    if causal_offset is not None:
        qi = torch.arange(q.shape[3], device=keys.device)[:, None]
        kj = torch.arange(s, device=keys.device)[None, :]
        visible = visible & (kj <= causal_offset + qi)
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    if query_mask is not None:
        probs = probs * query_mask[:, None, None, :, None].to(probs.dtype)
    return _pool_groups(probs.sum(dim=3), gqa_pooling)                      # [n, Hkv, S]
