"""Next-token sampling with both log-prob kinds, reproducible per sample.

Randomness: every sample (prompt g, index i) draws its uniforms from its own generator seeded from
``(seed, g, i)``, so a sample does not depend on how samples were batched. A token is drawn by inverse-CDF
on the filtered distribution (float64 cumulative sum), which never picks a zero-probability token.

Log-probs returned per sampled token:
- ``logprob``: ``log_softmax(logits)`` at temperature 1, unfiltered (what Sparse-RL's ratio uses);
- ``logprob_scaled``: the log-prob under the distribution actually sampled from (temperature, top-k,
  top-p applied and renormalised); 0 for greedy (temperature 0: a point mass).
"""
from __future__ import annotations

import hashlib

import torch

from sparse_rl_megatron.rollout.engine_protocol import SamplingParams


def sample_seed(seed: int, group: int, index: int) -> int:
    """A 63-bit seed for sample ``index`` of prompt ``group`` (independent streams per sample)."""
    digest = hashlib.sha256(f"sparse-rl:{seed}:{group}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw_uniforms(seed: int, group: int, index: int, count: int) -> torch.Tensor:
    """[count] float64 uniforms in [0, 1) for one sample, one per decode step."""
    gen = torch.Generator(device="cpu").manual_seed(sample_seed(seed, group, index))
    return torch.rand(count, generator=gen, dtype=torch.float64)


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and the top-p nucleus. scaled: [R, V] float32 logits / T.

    Nucleus: the most likely tokens whose cumulative probability first reaches ``top_p`` (the crossing token
    included); ties in probability are ordered by token id (stable sort), so the result is deterministic.
    """
    if top_k <= 0 and top_p >= 1.0:
        return scaled
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if 0 < top_k < vocab:
        remove[:, top_k:] = True
    if top_p < 1.0:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs          # mass of the strictly more likely tokens
        remove |= before >= top_p
    remove[:, 0] = False
    return scaled.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams):
    """Pick one token per row.

    Args:
        logits: [R, V] float32 next-token logits.
        uniforms: [R] float64 in [0, 1) (ignored when greedy).
    Returns:
        tokens [R] int64, logprob [R] float32 (T=1, unfiltered), logprob_scaled [R] float32.
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    if params.temperature == 0.0:
        tokens = logits.argmax(dim=-1)  # first maximum: deterministic
        scaled_lp = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    else:
        filtered = filter_logits(logits / params.temperature, params.top_k, params.top_p)
        logp_scaled = torch.log_softmax(filtered, dim=-1)
        cdf = logp_scaled.double().exp().cumsum(dim=-1)
        target = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
        scaled_lp = logp_scaled.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), scaled_lp
