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

Where that worst case is too loose to see the defects a check is for (the rollout engines' log-prob oracles: ~1e-2
against 1e-3 defects), the second model below is used: the same roundings taken as independent random errors
(Higham & Mary 2019), bounded with Hoeffding's inequality at ``LAMBDA``; errors then grow like ``sqrt(K) u``.
"""
from __future__ import annotations

import math

from sparse_rl_megatron.models.families import family_spec

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


def moe_layer_reductions(hidden: int, num_experts: int, top_k: int, expert_ffn: int, shared_ffn: int = 0) -> list[int]:
    """The reductions a mixture-of-experts MLP adds along one token's path, in place of a dense MLP's gate/up
    and down: the router's logits (hidden) and softmax denominator (experts), each chosen expert's gate/up
    (hidden) and down (``expert_ffn``), the weighted sum of the ``top_k`` expert outputs (+ the shared expert's),
    and a shared expert's gate/up, down and sigmoid gate (Qwen2-MoE). A token routed to other experts is not a
    rounding: the parity tests check the routing margins separately (``router_margin``)."""
    out = [hidden, num_experts, hidden, expert_ffn, top_k + (1 if shared_ffn else 0)]
    if shared_ffn:
        out += [hidden, shared_ffn, hidden]
    return out


def moe_transformer_reductions(hidden: int, head_dim: int, heads: int, layers: int, keys: int, num_experts: int,
                               top_k: int, expert_ffn: int, shared_ffn: int = 0) -> list[int]:
    """``transformer_reductions`` of a decoder whose every MLP is a mixture of experts (``moe_layer_reductions``)."""
    layer = [hidden, hidden, head_dim, keys, heads * head_dim, hidden]
    layer += moe_layer_reductions(hidden, num_experts, top_k, expert_ffn, shared_ffn)
    return layer * layers + [hidden, hidden]


def forward_logprob_bound(reductions: list[int], vocab: int, max_abs_logit: float, u: float = U_FP32) -> float:
    """Two implementations (or batch compositions, or kernel paths) of the same forward, compared on log-probs:
    twice the logits' ``chain_bound`` (log_softmax is 1-Lipschitz in each logit, max-norm) plus each side's
    logsumexp over the vocabulary."""
    return 2 * chain_bound(reductions, max_abs_logit, u) + 2 * SAFETY * gamma(vocab, u)


def hf_config_reductions(config, keys: int) -> list[int]:
    """``transformer_reductions`` of an HF Llama / Qwen2 / Qwen3 (or Qwen MoE) config attending to ``keys``
    positions."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if is_moe_config(config):
        return moe_transformer_reductions(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_hidden_layers, keys, config.num_experts,
                                          config.num_experts_per_tok, config.moe_intermediate_size,
                                          getattr(config, "shared_expert_intermediate_size", 0) or 0)
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



# ---- the probabilistic model: engine-vs-reference log-probs at a tolerance that still sees a 1e-3 defect ------
#
# The bounds above are worst cases: every rounding at its largest and of one sign, along every stage of the
# chain. For the tiny decoders of the rollout tests they come to ~1e-2 on log-probs, which would let a 1e-3
# defect through. The log-prob comparisons of the rollout engines (the HF engine against full forwards, against
# HF ``generate`` and against its own replays; SGLang against the HF engine's replay and against full forwards)
# take their tolerance from the model below instead (``hf_logprob_tolerance``).
#
# (P1) Every float32 operation rounds as ``x (1 + delta)``, the ``delta`` independent, of mean zero, ``|delta|
#      <= u`` (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput.
#      41(5), 2019). Roundings are not random, but those of different partial sums of different data behave as
#      if they were; this is why errors grow like ``sqrt(K) u`` and not ``K u``.
# (P2) First order, the gap between two computations of one log-prob is ``sum_r delta_r c_r`` over the roundings
#      ``r`` of both, ``c_r`` the log-prob's sensitivity to rounding ``r``. Hoeffding: a sum of independent,
#      mean-zero terms ``|delta_r c_r| <= u |c_r|`` exceeds ``LAMBDA u sqrt(sum_r c_r^2)`` with probability at
#      most ``2 exp(-LAMBDA^2 / 2)``: no distribution is assumed beyond (P1). Roundings the two computations share
#      (the same kernel on the same data) are counted on both sides, which only loosens the bound.
# (P3) A K-term sum with terms of no common sign (a matmul's dot products, attention's weighted sum of values):
#      K additions with the partial sums ``s_j`` as coefficients and K products (terms ``t_j``). The partial sums
#      are a random walk, ``E s_j^2 = (j / K) |t|_2^2``, so ``sum_j c_j^2 = (K / 2 + 1) |t|_2^2`` per side,
#      ``(K + 2) |t|_2^2`` for both; the +2 also covers a few elementwise roundings (bias, activation, residual
#      add). Each stage's output reaches the logits through normalised layers at unchanged relative size (the
#      first-order assumption of ``chain_bound``): component i of a hidden vector carries its roundings, of its
#      own size, into logit ``v`` with weight ``W_vi``, so in logit units every stage's terms have the size of
#      the LM head's own, ``S = max_(v, position) |W_v * h|_2`` (``h`` the final hidden state, ``W`` the head).
# (P4) A sum of positive terms whose result scales a whole vector (an RMSNorm's mean of squares, a softmax's
#      denominator): partial sums are at most the total, so ``K + 1`` coefficients of relative size <= 1 per
#      side, +2 for the reciprocal square root and the multiply. A relative change ``e`` of every logit moves
#      ``log p_t`` by ``e (z_t - E_p z)``: these count at ``G = max |z_t - E_p z|`` over the compared tokens
#      (the final norm does exactly this; an earlier norm or softmax reaches the logits at most so, first order).
# (P5) ``log_softmax``: ``d log p_t = dz_t - sum_v p_v dz_v`` has ``sum_r c_r'^2 <= 4 max_v sum_r c_(r,v)^2``
#      (Cauchy-Schwarz and Jensen) for the (P3) roundings; each side's ``logsumexp`` adds V additions and V
#      exponentials with coefficients at most 1 (2 V for the two sides), and the subtraction of the max logit
#      ``2 u max|z|`` per side, deterministically.
# Together: ``LAMBDA u sqrt(4 S^2 sum_mixed (K + 2) + 2 G^2 sum_coherent (K + 3) + 2 V) + 4 u max|z|``.
LAMBDA = 6.5
"""Hoeffding multiplier of the probabilistic bound: a compared log-prob exceeds it with probability at most
``2 exp(-6.5^2 / 2) = 1.4e-9`` under the model; a test compares fewer than ~1e4 log-probs, so a correct
implementation fails it with probability below ~1e-5 (union bound)."""


def decoder_sums(hidden: int, head_dim: int, heads: int, intermediate: int, layers: int, keys: int,
                 qk_norm: bool = False) -> tuple[list[int], list[int]]:
    """The sums along one token's path to its logits in a Llama / Qwen decoder, as ``(mixed, coherent)``:
    mixed-sign sums (P3), per layer the q/k/v projections (hidden), the scores (head_dim), the weighted sum of
    values (``keys``), the output projection (heads x head_dim), gate/up (hidden), down (intermediate), then the
    LM head (hidden); positive sums that scale a vector (P4), per layer the two RMSNorms (hidden), the softmax
    denominator (``keys``) and Qwen3's q / k norms (head_dim, ``qk_norm``), then the final norm (hidden)."""
    mixed = [hidden, head_dim, keys, heads * head_dim, hidden, intermediate] * layers + [hidden]
    coherent = ([hidden, keys, hidden] + ([head_dim, head_dim] if qk_norm else [])) * layers + [hidden]
    return mixed, coherent


def probabilistic_logprob_bound(mixed: list[int], coherent: list[int], vocab: int, term_scale: float,
                                spread: float, max_abs_logit: float, u: float = U_FP32,
                                lam: float = LAMBDA) -> float:
    """Two computations of the same log-prob that round differently, under (P1)-(P5):
    ``lam u sqrt(4 S^2 sum(K + 2 | mixed) + 2 G^2 sum(K + 3 | coherent) + 2 V) + 4 u max|z|`` with
    ``S = term_scale`` (``max |W_v * h|_2``), ``G = spread`` (``max |z_t - E_p z|`` over the compared tokens)."""
    q = (4 * term_scale ** 2 * sum(k + 2 for k in mixed) + 2 * spread ** 2 * sum(k + 3 for k in coherent)
         + 2 * vocab)
    return lam * u * math.sqrt(q) + 4 * u * max_abs_logit


def moe_decoder_sums(hidden: int, head_dim: int, heads: int, layers: int, keys: int, num_experts: int, top_k: int,
                     expert_ffn: int, shared_ffn: int = 0, qk_norm: bool = False) -> tuple[list[int], list[int]]:
    """``decoder_sums`` of a decoder whose every MLP is a mixture of experts: per layer the mixed-sign sums of the
    router's logits (hidden), an expert's gate/up (hidden) and down (``expert_ffn``), the weighted sum of the
    chosen experts (``top_k``, + 1 with a shared expert, whose gate/up, down and sigmoid gate add hidden,
    ``shared_ffn``, hidden) in place of the dense MLP's; and the router softmax's denominator (``num_experts``)
    among the positive sums. Routing decisions are not roundings (``router_margin``)."""
    mixed = [hidden, head_dim, keys, heads * head_dim, hidden, hidden, expert_ffn, top_k + (1 if shared_ffn else 0)]
    if shared_ffn:
        mixed += [hidden, shared_ffn, hidden]
    coherent = [hidden, keys, hidden, num_experts] + ([head_dim, head_dim] if qk_norm else [])
    return mixed * layers + [hidden], coherent * layers + [hidden]


def is_moe_config(config) -> bool:
    """An HF Qwen3-MoE / Qwen2-MoE config (every layer a mixture of experts)."""
    return family_spec(config.model_type).moe


def hf_decoder_sums(config, keys: int) -> tuple[list[int], list[int]]:
    """``decoder_sums`` of an HF Llama / Qwen2 / Qwen3 (or Qwen3-MoE / Qwen2-MoE) config attending to at most
    ``keys`` positions."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qk_norm = family_spec(config.model_type).qk_norm
    if is_moe_config(config):
        return moe_decoder_sums(config.hidden_size, head_dim, config.num_attention_heads, config.num_hidden_layers,
                                keys, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                                getattr(config, "shared_expert_intermediate_size", 0) or 0, qk_norm=qk_norm)
    return decoder_sums(config.hidden_size, head_dim, config.num_attention_heads, config.intermediate_size,
                        config.num_hidden_layers, keys, qk_norm=qk_norm)


def router_margin(router_logits, top_k: int) -> float:
    """The smallest gap, over tokens, between the k-th and the (k+1)-th largest router logit (``[T, E]``): two
    computations of the same router pick the same experts while their logits differ by less than half of it.
    (Ranking by softmax scores or by logits is the same order.)"""
    import torch

    top = torch.topk(router_logits.detach().float(), top_k + 1, dim=-1).values
    return float((top[:, top_k - 1] - top[:, top_k]).min())


def hf_logprob_tolerance(model, prompts: list[list[int]], responses: list[list[int]], u: float = U_FP32,
                         lam: float = LAMBDA) -> float:
    """``probabilistic_logprob_bound`` for the log-probs of ``responses`` (token ids) after ``prompts`` under the
    HF causal LM ``model``, computed two ways (an engine against a reference): its config's sums at the longest
    sequence (a position attends at most that many keys, compressed or not); ``S``, ``G`` and ``max|z|``
    measured from the model's own final hidden states, LM head and logits over those tokens."""
    import torch

    head = model.get_output_embeddings().weight.detach().float()  # [V, H]
    scale = spread = max_logit = 0.0
    with torch.no_grad():
        for prompt, response in zip(prompts, responses):
            ids = torch.tensor([list(prompt) + list(response)])
            h = model.model(ids).last_hidden_state[0, len(prompt) - 1:-1].float()  # [R, H], after the final norm
            z = h @ head.T  # [R, V]
            mean = (z.softmax(-1) * z).sum(-1)  # E_p z per position
            picked = z.gather(-1, torch.tensor(list(response))[:, None])[:, 0]
            scale = max(scale, ((h * h) @ (head * head).T).max().sqrt().item())
            spread = max(spread, (picked - mean).abs().max().item())
            max_logit = max(max_logit, z.abs().max().item())
    keys = max(len(p) + len(r) for p, r in zip(prompts, responses))
    mixed, coherent = hf_decoder_sums(model.config, keys)
    return probabilistic_logprob_bound(mixed, coherent, model.config.vocab_size, scale, spread, max_logit, u, lam)


TOLERANCE_LOG_ENV = "SPARSE_RL_TOLERANCE_LOG"
"""When set, ``assert_logprobs_within`` appends one JSON line per comparison (what, measured max |delta|, bound)
to that file: how the bounds' margins are measured on each kernel path."""


def assert_logprobs_within(got, want, bound: float, what: str) -> float:
    """``max |got - want| <= bound`` (tensors of log-probs), with both numbers in the message; returns the gap."""
    import json
    import os

    gap = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    if os.environ.get(TOLERANCE_LOG_ENV):
        with open(os.environ[TOLERANCE_LOG_ENV], "a") as f:
            f.write(json.dumps({"what": what, "max_abs_delta": gap, "bound": bound}) + "\n")
    assert gap <= bound, f"{what}: max |delta log-prob| {gap:.3g} > bound {bound:.3g}"
    return gap
