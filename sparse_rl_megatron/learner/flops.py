"""Model FLOPs of the learner's forward pass, counted as computed: for MFU in ``bench/bench_learner.py``.

A matmul of ``[m, k] x [k, n]`` is ``2 m k n`` FLOPs. Per decoder layer and fed token: the Q/K/V projection
(``h x (q + 2 kv)``), the output projection (``q x h``) and the SwiGLU MLP (three ``h x f`` matmuls), with
``q = heads x head_dim`` and ``kv = groups x head_dim``. Causal attention: token ``i`` of a row scores and mixes
the ``i + 1`` positions up to it (``Q K^T`` and ``P V``: ``2 x 2 q (i + 1)``), rows never see each other. The
LM head runs only on the scored (response) tokens (``learner/logprobs.py``), not on every fed token.
Norms, RoPE, softmax and the loss are left out (a fraction of a percent at these sizes). A training step is
3x the forward (backward = 2x); recomputation is not model FLOPs and is not counted.
"""
from __future__ import annotations

from typing import Sequence

from sparse_rl_megatron.models.arch import ModelArch


def forward_flops(arch: ModelArch, fed_lengths: Sequence[int], scored_tokens: int) -> float:
    """FLOPs of one forward over rows of ``fed_lengths`` tokens, ``scored_tokens`` of them through the LM head."""
    h, f, L = arch.hidden_size, arch.ffn_hidden_size, arch.num_layers
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    per_token = 2 * (h * (q + 2 * kv) + q * h + 3 * h * f)
    causal_pairs = sum(n * (n + 1) // 2 for n in fed_lengths)
    decoder = L * (per_token * sum(fed_lengths) + 2 * 2 * q * causal_pairs)
    return float(decoder + 2 * arch.vocab_size * h * scored_tokens)


def train_step_flops(arch: ModelArch, fed_lengths: Sequence[int], scored_tokens: int) -> float:
    """Model FLOPs of one training step: forward + backward (twice the forward)."""
    return 3 * forward_flops(arch, fed_lengths, scored_tokens)
