"""TriAttention's query centers outside a rollout: calibrate them at some weights, save, load.

Online centers (``triattention_centers=online``, the default) need none of this: each sequence accumulates its own
(``kv_cache.CompressedKVCache``). Fixed centers (``file``) are what the authors ship: one forward over calibration
text, per layer and query head the mean pre-RoPE query and the mean pair modulus. In RL they are stale as soon as
the weights move; ``calibrate_centers`` at a weight version is how to refresh them (docs/algorithm.md, "TriAttention").
"""
from __future__ import annotations

from functools import lru_cache

import torch

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.kv_cache import CompressedKVCache


@torch.no_grad()
def calibrate_centers(decoder, input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Centers of an ``HFDecoder`` (``hf_forward``) over right-padded sequences, pooled over all their tokens.

    Args:
        input_ids: [R, P] long, right-padded.
        lengths: [R] real lengths.
    Returns:
        ([L, Hq, D] mean pre-RoPE query, [L, Hq, D / 2] mean pair modulus), float32 on the CPU.
    """
    rows, p = input_ids.shape
    config = CompressionConfig(method="triattention", budget=2, window=1)
    cache = CompressedKVCache(num_layers=decoder.num_layers, rows=rows, num_kv_heads=decoder.num_kv_heads,
                              num_q_heads=decoder.num_q_heads, head_dim=decoder.head_dim, capacity=p,
                              dtype=next(decoder.model.parameters()).dtype, config=config, scaling=decoder.scaling,
                              device=input_ids.device, rope_inv_freq=decoder.inv_freq)
    decoder.prefill(input_ids, lengths, cache)
    count = cache.qcount.sum(dim=1)[:, None, None]                                   # [L, 1, 1]
    return (cache.qsum.sum(dim=1) / count).cpu(), (cache.qabs.sum(dim=1) / count).cpu()


def save_centers(path: str, centers: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.save({"query_center": centers[0], "query_abs_center": centers[1]}, path)


@lru_cache(maxsize=4)
def load_centers(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``([L, Hq, D], [L, Hq, D / 2])`` from a ``save_centers`` file."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    return data["query_center"], data["query_abs_center"]
