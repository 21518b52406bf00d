"""Sampler: top-k / top-p filtering, inverse-CDF draws, both log-prob kinds, per-sample seeds."""
import math

import torch

from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sampling import draw_uniforms, filter_logits, sample_tokens

PROBS = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
LOGITS = PROBS.log()
NEG = float("-inf")


def test_top_k_and_top_p_filters():
    assert torch.isinf(filter_logits(LOGITS, 2, 1.0)).tolist() == [[True, False, True, False]]
    # nucleus 0.8: 0.5 then 0.3 reaches 0.8 -> keep 2 tokens; 0.81 needs the 0.15 token too
    assert torch.isinf(filter_logits(LOGITS, 0, 0.8)).tolist() == [[True, False, True, False]]
    assert torch.isinf(filter_logits(LOGITS, 0, 0.81)).tolist() == [[False, False, True, False]]
    assert torch.isinf(filter_logits(LOGITS, 0, 0.01)).tolist() == [[True, False, True, True]]  # keep >= 1
    assert torch.equal(filter_logits(LOGITS, 0, 1.0), LOGITS)
    tied = torch.zeros(1, 4)  # equal probabilities: lower token ids first (stable)
    assert torch.isinf(filter_logits(tied, 2, 1.0)).tolist() == [[False, False, True, True]]


def test_inverse_cdf_draw_and_logprobs():
    params = SamplingParams(temperature=1.0)
    logits = LOGITS.expand(4, -1)
    u = torch.tensor([0.0, 0.16, 0.66, 0.999], dtype=torch.float64)  # cdf: .15 .65 .70 1.0
    tokens, lp, lps = sample_tokens(logits, u, params)
    assert tokens.tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(lp, PROBS[0].log())
    torch.testing.assert_close(lps, lp)
    topk = SamplingParams(temperature=1.0, top_k=2)  # renormalised over {1: .5, 3: .3}
    tokens, lp, lps = sample_tokens(logits, u, topk)
    assert tokens.tolist() == [1, 1, 3, 3]
    torch.testing.assert_close(lps, torch.tensor([0.625, 0.625, 0.375, 0.375]).log())
    torch.testing.assert_close(lp, PROBS[0, tokens].log())


def test_temperature_and_greedy():
    tokens, lp, lps = sample_tokens(LOGITS, torch.tensor([0.3], dtype=torch.float64), SamplingParams(temperature=0.0))
    assert tokens.tolist() == [1] and lps.tolist() == [0.0]
    torch.testing.assert_close(lp, torch.tensor([math.log(0.5)]))
    hot = SamplingParams(temperature=2.0)
    tokens, lp, lps = sample_tokens(LOGITS, torch.tensor([0.0], dtype=torch.float64), hot)
    scaled = torch.log_softmax(LOGITS / 2.0, dim=-1)
    torch.testing.assert_close(lps, scaled[0, tokens])
    torch.testing.assert_close(lp, LOGITS.log_softmax(-1)[0, tokens])


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.tensor([[0.0, NEG, 0.0, NEG]]).expand(1000, -1)
    u = torch.rand(1000, dtype=torch.float64)
    u[-1] = 1.0 - 1e-16
    tokens, _, _ = sample_tokens(logits, u, SamplingParams())
    assert set(tokens.tolist()) == {0, 2}


def test_uniforms_per_sample_are_reproducible_and_distinct():
    assert torch.equal(draw_uniforms(1, 0, 0, 5), draw_uniforms(1, 0, 0, 5))
    assert not torch.equal(draw_uniforms(1, 0, 0, 5), draw_uniforms(1, 0, 1, 5))
    assert not torch.equal(draw_uniforms(1, 0, 0, 5), draw_uniforms(2, 0, 0, 5))
    assert torch.equal(draw_uniforms(1, 3, 2, 8)[:5], draw_uniforms(1, 3, 2, 5))
