"""Which tokens survive a compression: per KV head, the top ``B - alpha`` by score plus the alpha newest.

Deterministic: ties in score are broken in favour of the newer token (the larger candidate index), and
NaN scores rank below everything. The kept indices are returned in ascending order (the cache keeps the
original order), so every head keeps exactly B tokens but each head may keep different ones.
"""
from __future__ import annotations

import torch


def select_kept(scores: torch.Tensor, *, budget: int, window: int) -> torch.Tensor:
    """Indices of the kept candidates.

    Args:
        scores: [n, Hkv, N - alpha] float scores of the candidates before the window (higher = keep).
        budget: B (kept per head).
        window: alpha (the last alpha of the N candidates are always kept).
    Returns:
        [n, Hkv, B] int64 candidate indices in [0, N), ascending; the last alpha are ``N - alpha .. N - 1``.
    """
    n, hkv, past = scores.shape
    top = budget - window
    if top < 1 or top > past:
        raise ValueError(
            f"select_kept: need 1 <= budget - window <= candidates before the window; "
            f"got budget={budget}, window={window}, candidates={past + window}"
        )
    s = torch.nan_to_num(scores.float(), nan=float("-inf"))
    # Stable descending sort of the reversed scores: among equal scores the newer token comes first.
    order = torch.sort(s.flip(-1), dim=-1, descending=True, stable=True).indices[..., :top]
    chosen = (past - 1 - order).sort(dim=-1).values
    window_idx = torch.arange(past, past + window, device=scores.device).expand(n, hkv, window)
    return torch.cat([chosen, window_idx], dim=-1)


def gather_kept(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Gather the kept candidates of a per-head tensor.

    Args:
        x: [n, Hkv, N, *rest] (keys, values, positions, accumulators, ...).
        kept: [n, Hkv, B] from :func:`select_kept`.
    Returns:
        [n, Hkv, B, *rest].
    """
    index = kept.reshape(*kept.shape, *([1] * (x.dim() - 3))).expand(*kept.shape, *x.shape[3:])
    return torch.gather(x, 2, index)
