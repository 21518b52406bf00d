"""TriAttention's online query centers in the plugin: per request row, layer and query head, running sums.

What the HF reference cache keeps (``rollout/kv_cache.CompressedKVCache``, ``triattention=online``), kept here in
``RowState``: ``qsum`` [L, rows, Hq, D] the sum of the row's pre-RoPE queries, ``qabs`` [L, rows, Hq, D / 2] the sum of
their pair moduli (float32, on the device), and ``qcount`` [rows] the tokens summed (host: it is the tokens the
row fed through the model). Every token a compressing row feeds (prompt, chunks, decode) adds its queries in each
layer's ``forward_*`` (``backend._record_queries``), un-rotated with its logical position; a new request (or a
re-prefill after a retraction) starts from zero (``RowState.reset``). The mean is taken at a compression and fed to
the same scorer (``compression.scorers``, ``triattention.py``). Since every prompt token must pass through the
model, a server that keeps centers takes nothing from the radix tree (``hooks._max_prefix_len``).

Centers from a calibration file (``triattention_centers=file``) are refused at start (``config``).
"""
from __future__ import annotations

import torch

from sparse_rl_megatron.compression import center_sums


def rope_inv_freq(hf_config, head_dim: int) -> torch.Tensor:
    """[D / 2] float32 rotary frequencies of the model, as transformers computes them (what the HF engine un-rotates
    with). Rotary embeddings over part of the head, or whose frequencies change with the length, are refused."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial != 1.0 or kind == "dynamic":
        raise ValueError(f"compression.method triattention: the plugin un-rotates full-head static RoPE only; this "
                         f"model's rotary has rope_type '{kind}', partial_rotary_factor {partial}")
    if kind == "default":
        return 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")[0].float()


def add_queries(qsum: torch.Tensor, qabs: torch.Tensor, q: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Add post-RoPE queries ``q`` [T, Hq, D] of tokens at logical ``positions`` [T] of request ``rows`` [T] into one
    layer's sums ``qsum`` [rows, Hq, D], ``qabs`` [rows, Hq, D / 2]."""
    pre_sum, abs_sum, _ = center_sums(q[:, :, None, :], positions[:, None], inv_freq)   # each token alone
    qsum.index_add_(0, rows, pre_sum)
    qabs.index_add_(0, rows, abs_sum)
