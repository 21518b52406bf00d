"""The suite's floating-point error model: every tolerance of a comparison between two computations that are not
the same sequence of float operations comes from here, with its formula.

Why tolerances at all: two kernels (or two matrix shapes, two batch compositions, two CPUs: AVX-512 / AVX2 /
SSE paths of PyTorch, MKL and oneDNN) sum the same products in different orders, and float addition is not
associative. What stays exact is written as equality in the tests (the same kernel on the same data, integer
bookkeeping, copies); everything else is compared at a bound derived below.

The model (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3): with unit round-off ``u``, a sum of
``K`` terms in any order satisfies ``|fl(sum) - sum| <= gamma_K * sum |terms|`` with ``gamma_K = K u / (1 - K u)``.
Two orders therefore differ by at most ``2 gamma_K sum |terms|``. A chain of reductions (a transformer's forward)
adds the contributions of each stage, measured in the scale of the output being compared (first order; the
test models are two or three layers deep with normalised activations, so the chain does not amplify them by
more than the margin ``SAFETY`` below).
"""
from __future__ import annotations

import math

U_FP32 = 2.0 ** -24  # float32 unit round-off
U_BF16 = 2.0 ** -8  # bfloat16 unit round-off (8 bits of mantissa, 7 stored)
SAFETY = 4.0  # margin for the first-order model's neglected terms (products of errors, exp/log rounding)


def gamma(k: int, u: float = U_FP32) -> float:
    """``gamma_K = K u / (1 - K u)``: the relative bound of a K-term sum in any order."""
    if k * u >= 1:
        raise ValueError(f"gamma_K is undefined for K * u >= 1 (K={k}, u={u})")
    return k * u / (1 - k * u)


def reorder_bound(k: int, abs_sum: float, u: float = U_FP32) -> float:
    """The most two summation orders of K terms whose absolute values sum to ``abs_sum`` can differ by."""
    return 2 * gamma(k, u) * abs_sum


def chain_bound(reductions: list[int], scale: float, u: float = U_FP32) -> float:
    """Two evaluations of a chain of reductions (lengths ``reductions``) whose outputs are of size ``scale``:
    ``SAFETY * sum_i 2 gamma_{K_i} * scale``."""
    return SAFETY * sum(2 * gamma(k, u) for k in reductions) * scale


def transformer_reductions(hidden: int, head_dim: int, heads: int, intermediate: int, layers: int,
                           keys: int) -> list[int]:
    """The reduction lengths along one token's path from the embedding to its logits in a Llama / Qwen
    decoder: per layer the RMSNorm's mean of squares (hidden), the q/k/v projections (hidden), the scores
    (head_dim), the weighted sum of values (``keys`` attended), the output projection (heads x head_dim), the
    second norm (hidden), gate/up (hidden) and down (intermediate); then the final norm and the LM head."""
    layer = [hidden, hidden, head_dim, keys, heads * head_dim, hidden, hidden, intermediate]
    return layer * layers + [hidden, hidden]


def forward_logprob_bound(reductions: list[int], vocab: int, max_abs_logit: float, u: float = U_FP32) -> float:
    """Two implementations (or batch compositions, or kernel paths) of the same forward, compared on log-probs:
    twice the logits' ``chain_bound`` (log_softmax is 1-Lipschitz in each logit, max-norm) plus each side's
    logsumexp over the vocabulary."""
    return 2 * chain_bound(reductions, max_abs_logit, u) + 2 * SAFETY * gamma(vocab, u)


def hf_config_reductions(config, keys: int) -> list[int]:
    """``transformer_reductions`` of an HF Llama / Qwen2 / Qwen3 config attending to ``keys`` positions."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return transformer_reductions(config.hidden_size, head_dim, config.num_attention_heads,
                                  config.intermediate_size, config.num_hidden_layers, keys)


def logprob_head_bound(hidden: int, vocab: int, max_hidden_norm: float, max_row_norm: float,
                       max_abs_logit: float, u: float = U_FP32) -> float:
    """Two evaluations of ``log_softmax(h @ W.T)[token]`` from the same hidden state ``h`` (``[H]``) and LM head
    ``W`` (``[V, H]``) with different matmul shapes (a chunked and an unchunked head).

    Each logit ``z_v = sum_i h_i W_vi`` is a sum of ``H`` products with ``sum_i |h_i W_vi| <= |h|_2 |W_v|_2``
    (Cauchy-Schwarz), so the two logits differ by ``dz <= 2 gamma_H |h|_2 max_v |W_v|_2``; ``log_softmax`` is
    1-Lipschitz in each argument in the max-norm, which moves a log-prob by at most ``2 dz``. Each side's own
    ``logsumexp`` over ``V`` terms adds ``gamma_V`` (relative, inside the log) plus a few ``u |z|`` for the
    subtraction of the max: ``2 (gamma_V + 3 u max|z|)`` for the two sides.
    """
    dz = reorder_bound(hidden, max_hidden_norm * max_row_norm, u)
    return SAFETY * (2 * dz + 2 * (gamma(vocab, u) + 3 * u * max_abs_logit))


def flip_probability(tokens: int, logprob_bound: float) -> float:
    """Bound on the chance that a sampled trajectory changes when every log-prob moves by at most
    ``logprob_bound``: inverse-CDF sampling with one uniform draw per token changes a token only when the draw
    falls within ``sum_v p_v |d p_v / p_v| <= e^b - 1`` of a bucket edge, at most twice that per token (two
    edges of the drawn bucket move), summed over the trajectory's tokens."""
    return min(1.0, tokens * 2 * math.expm1(logprob_bound))
