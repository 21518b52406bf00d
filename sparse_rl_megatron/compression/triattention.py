"""TriAttention's key score: a trigonometric series over the pre-RoPE query centers, plus a norm term.

TriAttention (Mao et al., 2026, arXiv 2604.04921; authors' code github.com/WeianMao/triattention, read for the
formulas, nothing copied). RoPE rotates each pair ``f`` of a head (HF's rotate-half layout: dims ``f`` and
``f + D/2``, the complex number ``z_f = x_f + i x_{f+D/2}``) by ``omega_f * position``. Before RoPE a head's queries
concentrate around a center, so the logit a future query at position ``t + d`` gives a key ``k`` at position
``p`` is, with the query replaced by its center ``E[q]`` (pre-RoPE, per query head):

    trig(k) = mean_{d in D} sum_f |E q_f| |k_f| cos(omega_f (t - p + d) + arg(E q_f conj k_f))
    norm(k) = sum_f (E|q_f| - |E q_f|) |k_f|
    score   = trig + norm

``k_f`` is the pre-RoPE key pair, ``t`` the position of the next token (one past the newest cached token),
``D = {1, 2, 4, ..., 2^m <= max_offset}`` the authors' geometric future offsets (mean aggregation), and the norm
term is their "MLR" term: the part of ``E|q_f|`` the center does not explain, times the key's norm.

How we compute it (the same values, no un-rotation of the keys): ``E q_f conj(k_f) e^{i omega_f (t - p)} =
(E q_f e^{i omega_f t}) conj(k_f e^{i omega_f p})`` and ``k_f e^{i omega_f p}`` is the post-RoPE key both
engines cache, so the trigonometric term is one dot product of the post-RoPE key with a virtual query
``Q_f = E q_f * e^{i omega_f t} * mean_d e^{i omega_f d}``, and ``|k_f|`` is the same before and after the
rotation. Keys need neither their positions nor an inverse RoPE; only the centers do (``unrotate``).

Per layer and query head the scores are standardised over the N candidates (the authors' default
``normalize_scores``: mean, population std clamped at 1e-6), then the query heads of a GQA group are pooled
with ``max`` (the authors' per-(layer, KV head) selection, ``per_layer_perhead_pruning`` with max aggregation).
A rotary ``attention_scaling`` s multiplies every score of a head by the same factor, which the standardisation
removes; it is ignored here.
"""
from __future__ import annotations

import torch

NORM_EPS = 1e-6
"""Floor of the per-head standard deviation in the standardisation (the authors' clamp)."""


def future_offsets(max_offset: int, device=None) -> torch.Tensor:
    """[M] float64 ``1, 2, 4, ..., 2^m <= max_offset`` (the authors' geometric offsets; 17 for 65536)."""
    if max_offset < 1:
        raise ValueError(f"triattention max_offset must be >= 1; got {max_offset}")
    # 2.0 ** k computed where the offsets are used (exact for integer k): no host data copied to a device
    return 2.0 ** torch.arange(max_offset.bit_length(), dtype=torch.float64, device=device)


def unrotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Undo HF's rotate-half RoPE: the pre-RoPE vectors.

    Args:
        x: [..., T, D] post-RoPE queries or keys.
        positions: [..., T] (broadcastable) logical positions they were rotated with.
        inv_freq: [D / 2] the rotary's ``inv_freq`` (omega_f), on the device of ``x`` (not moved: no copy per call).
    Returns:
        [..., T, D] float32.
    """
    half = x.shape[-1] // 2
    angle = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    cos, sin = angle.cos().float(), angle.sin().float()
    re, im = x[..., :half].float(), x[..., half:].float()
    # z e^{-i angle}
    return torch.cat([re * cos + im * sin, im * cos - re * sin], dim=-1)


def pair_norms(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D / 2] moduli ``|z_f|`` of the rotate-half pairs (the same before and after RoPE)."""
    half = x.shape[-1] // 2
    return torch.hypot(x[..., :half].float(), x[..., half:].float())


def center_sums(queries: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the query centers accumulate from some post-RoPE queries (sum over the tokens).

    Args:
        queries: [R, Hq, T, D] post-RoPE queries.
        positions: [R, T] their logical positions.
        inv_freq: [D / 2].
        mask: optional [R, T] bool, True for real tokens (padding adds nothing).
    Returns:
        ``(sum q, sum |q_f|, count)``: [R, Hq, D], [R, Hq, D / 2] float32 and [R] float32.
    """
    pre = unrotate(queries, positions[:, None, :], inv_freq)                     # [R, Hq, T, D]
    weight = (torch.ones(positions.shape, device=queries.device) if mask is None
              else mask.to(device=queries.device, dtype=torch.float32))          # [R, T]
    w = weight[:, None, :, None]
    return (pre * w).sum(dim=2), (pair_norms(pre) * w).sum(dim=2), weight.sum(dim=1)


def triattention_logits(
    keys: torch.Tensor,
    query_center: torch.Tensor,
    query_abs_center: torch.Tensor,
    query_position: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    max_offset: int = 65536,
) -> torch.Tensor:
    """The raw TriAttention score ``trig + norm`` of every candidate for every query head (module docstring).

    Args:
        keys: [n, Hkv, N, D] post-RoPE keys of the candidates.
        query_center: [n, Hq, D] mean pre-RoPE query of each head (``E q``, rotate-half layout).
        query_abs_center: [n, Hq, D / 2] mean pair modulus ``E |q_f|``.
        query_position: [n] long, ``t``: the position of the next token (newest cached position + 1).
        inv_freq: [D / 2] the rotary's ``inv_freq``; it and ``query_position`` on the keys' device (not moved).
        max_offset: largest future offset (the offsets are the powers of two up to it).
    Returns:
        [n, Hkv, G, N] float32, G = Hq / Hkv (query head ``h`` is ``[h // G, h % G]``).
    """
    n, hkv, length, d = keys.shape
    hq = query_center.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    half = d // 2
    omega = inv_freq.to(torch.float64)                                                   # [F] (on the keys' device)
    mean_phase = torch.polar(torch.ones_like(omega), omega[None, :] * future_offsets(max_offset, keys.device)[:, None]
                             ).mean(dim=0)                                               # [F] mean_d e^{i w d}
    now = torch.polar(torch.ones(n, half, dtype=torch.float64, device=keys.device),
                      query_position.to(torch.float64)[:, None] * omega)                  # [n, F]
    center = torch.complex(query_center[..., :half].double(), query_center[..., half:].double())    # [n, Hq, F]
    virtual = (center * (now * mean_phase)[:, None, :]).to(torch.complex64)              # [n, Hq, F]
    v = torch.cat([virtual.real, virtual.imag], dim=-1)                                  # [n, Hq, D]
    group = hq // hkv
    k = keys.float()
    # Re(Q_f conj K_f) summed over f = the real dot product of [Re Q, Im Q] with the rotate-half key
    trig = torch.matmul(v.view(n, hkv, group, d), k.transpose(-1, -2))                   # [n, Hkv, G, N]
    excess = (query_abs_center.float() - center.abs().float()).view(n, hkv, group, half)
    norm = torch.matmul(excess, pair_norms(k).transpose(-1, -2))                         # [n, Hkv, G, N]
    return trig + norm


def triattention_scores(keys: torch.Tensor, query_center: torch.Tensor, query_abs_center: torch.Tensor,
                        query_position: torch.Tensor, inv_freq: torch.Tensor, *, max_offset: int = 65536
                        ) -> torch.Tensor:
    """TriAttention score per KV head: ``triattention_logits`` standardised over the N candidates per query
    head, then the max over the query heads of each GQA group. Arguments as there; returns [n, Hkv, N] float32."""
    score = triattention_logits(keys, query_center, query_abs_center, query_position, inv_freq, max_offset=max_offset)
    mean = score.mean(dim=-1, keepdim=True)
    std = score.std(dim=-1, unbiased=False, keepdim=True).clamp_min(NORM_EPS)
    return ((score - mean) / std).amax(dim=2)
