"""R-KV's redundancy score: how much each key duplicates the other keys of the same head.

Source: R-KV (Cai et al., 2025, arXiv 2505.24133) and its reference code. Per head: cosine similarity
between all keys, diagonal zeroed; in each row, the entry of the most recent key whose similarity exceeds
the threshold is zeroed (so the newest of a run of duplicates is not counted as redundant by the others);
each column is averaged over the rows; softmax over tokens.

One deliberate difference from the reference code: there, a row with no similar key zeroes column 0
(an artefact of ``torch.where(mask, arange, 0).max()``); here such a row zeroes nothing.
"""
from __future__ import annotations

import torch

NORM_EPS = 1e-8
"""Added to key norms before dividing (R-KV's value), so an all-zero key gives similarity 0, not NaN."""


def key_redundancy(keys: torch.Tensor, *, threshold: float = 0.5) -> torch.Tensor:
    """Redundancy of every key.

    Args:
        keys: [n, Hkv, N, D] post-RoPE keys, oldest first.
        threshold: cosine similarity above which two keys are duplicates.
    Returns:
        [n, Hkv, N] float32, a softmax over N per head (higher = more redundant).
    """
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + NORM_EPS)
    sim = torch.matmul(k, k.transpose(-1, -2))                              # [n, Hkv, N, N]
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    similar = sim > threshold
    similar.diagonal(dim1=-2, dim2=-1).fill_(False)
    length = sim.shape[-1]
    # newest similar key of each row: first True from the right (argmax returns the first maximum)
    newest = length - 1 - similar.flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)   # [n, Hkv, N, 1]
    has_similar = similar.any(dim=-1, keepdim=True)
    sim.scatter_(-1, newest, torch.where(has_similar, 0.0, sim.gather(-1, newest)))
    return sim.mean(dim=-2).softmax(dim=-1)
