"""The rollout engines' log-prob tolerance (``numerics.hf_logprob_tolerance``: the HF engine's oracles in
``test_rollout_hf_engine.py``, SGLang against the HF engine in ``tests/sglang``) still catches what those checks are
there for: each seeded defect below, applied to the same tiny models and sampled sequences, moves log-probs past
the bound by a wide margin; and the model's basic claim, that K-term sums in two orders differ like
``sqrt(K) u |terms|_2``, holds for real summation orders."""
from __future__ import annotations

import math

import numerics
import pytest
import torch

from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer

PROMPTS = ["Let x be a real number such that", "First, 2 + 3 = 5. Then 5 * 4 = 20. Finally"]
MODELS = {"hf_engine_tier": 1, "sglang_tier": 3}
"""The tiny Qwen2 (init_std 0.2) seeds of ``test_rollout_hf_engine.py`` and of ``tests/sglang``."""
WIDE = 10.0
"""A structural defect (a wrong kept token, a position off by one) must exceed the bound this many times over."""


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    """(model, samples, bound): T=1 samples of the tier's model and their tolerance."""
    model = build_tiny_model("qwen2", init_std=0.2, seed=MODELS[request.param])
    engine = HFRolloutEngine(model, build_tiny_tokenizer(), show_progress=False)
    samples = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=30, seed=0,
                                                         ignore_eos=True))
    bound = numerics.hf_logprob_tolerance(model, [s.prompt_ids for s in samples], [s.response_ids for s in samples])
    return model, samples, bound


def _logprobs(model, sample, attention_mask=None, position_ids=None, logit_shift: float = 0.0):
    """log pi(y_t) of the response tokens from one forward over prompt + response (optionally masked, with other
    positions, or with ``logit_shift`` added to every scored token's logit)."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits[0].float()
    p = len(sample.prompt_ids)
    picked = torch.tensor(sample.response_ids)[:, None]
    z = logits[p - 1:].scatter_add(-1, picked, torch.full(picked.shape, logit_shift))
    return torch.log_softmax(z, dim=-1).gather(-1, picked)[:, 0]


def _streaming_mask(sample, sinks: int = 2, recent: int = 8, wrong: bool = False) -> torch.Tensor:
    """[1, 1, T, T] bool: causal for the prompt; each response query sees the first ``sinks`` tokens and the last
    ``recent`` (itself included). ``wrong``: a cache that kept one wrong token, the one before its oldest recent
    token instead of that token (an off-by-one eviction)."""
    total = len(sample.prompt_ids) + len(sample.response_ids) - 1
    vis = torch.ones(total, total, dtype=torch.bool).tril()
    for q in range(len(sample.prompt_ids), total):
        keep = set(range(min(sinks, q + 1))) | set(range(max(0, q - recent + 1), q + 1))
        oldest = q - recent + 1
        if wrong and oldest - 1 >= sinks:
            keep = (keep - {oldest}) | {oldest - 1}
        vis[q] = False
        vis[q, sorted(keep)] = True
    return vis[None, None]


def test_the_bound_is_far_below_the_worst_case(case):
    """The point of the probabilistic model: tight enough to see a 1e-3 defect (bound < 2e-4), unlike the worst case
    (``forward_logprob_bound``, ~1e-2)."""
    model, samples, bound = case
    keys = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    with torch.no_grad():
        max_logit = max(model(torch.tensor([s.prompt_ids + s.response_ids])).logits.abs().max().item()
                        for s in samples)
    worst = numerics.forward_logprob_bound(numerics.hf_config_reductions(model.config, keys),
                                           model.config.vocab_size, max_logit)
    assert bound < 2e-4 and worst > 30 * bound, (bound, worst)


def test_a_cache_that_keeps_one_wrong_token_exceeds_the_bound(case):
    model, samples, bound = case
    gap = max((_logprobs(model, s, attention_mask=_streaming_mask(s, wrong=True))
               - _logprobs(model, s, attention_mask=_streaming_mask(s))).abs().max().item() for s in samples)
    assert gap > WIDE * bound, (gap, bound)


def test_response_positions_off_by_one_exceed_the_bound(case):
    """RoPE positions of the response one too far (a decode step that counts the new token twice)."""
    model, samples, bound = case

    def shifted(s):
        p, total = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids) - 1
        pos = torch.arange(total)
        pos[p:] += 1
        return pos[None]

    gap = max((_logprobs(model, s, position_ids=shifted(s)) - _logprobs(model, s)).abs().max().item()
              for s in samples)
    assert gap > WIDE * bound, (gap, bound)


def test_a_1e3_logit_perturbation_exceeds_the_bound(case):
    """Every scored token's logit 1e-3 too high (a bias, a skipped rescale): log p_t moves by 1e-3 (1 - p_t)."""
    model, samples, bound = case
    gap = max((_logprobs(model, s, logit_shift=1e-3) - _logprobs(model, s)).abs().max().item() for s in samples)
    assert gap > 5 * bound, (gap, bound)


@pytest.mark.parametrize("k", [64, 256, 4096])
def test_two_real_summation_orders_stay_within_the_probabilistic_sum_bound(k):
    """(P1)-(P3) on single dot products: forward and backward recursive sums of K products of random vectors differ
    by at most ``LAMBDA u sqrt(K + 2) |t|_2`` (1000 trials), while the worst-case bound is ~sqrt(K) times looser."""
    gen = torch.Generator().manual_seed(k)
    t = torch.randn(1000, k, generator=gen) * torch.randn(1000, k, generator=gen)  # 1000 trials of K products
    forward, backward = torch.zeros(1000), torch.zeros(1000)
    for j in range(k):  # float32 recursive sums, one addition (one rounding) at a time
        forward += t[:, j]
        backward += t[:, k - 1 - j]
    gap = (forward - backward).abs()
    bound = numerics.LAMBDA * numerics.U_FP32 * math.sqrt(k + 2) * t.norm(dim=-1)
    assert (gap <= bound).all()
    assert (gap / bound).max() > 1 / (5 * numerics.LAMBDA)  # not vacuous: the largest gap is within ~30x of it
