"""Sparsity ratio: exact values, clamp, NaN handling, and WHICH log-probs go into each ratio."""
import math

import pytest
import torch

from sparse_rl_megatron.algo import (
    CorrectionConfig,
    LOG_RATIO_CLAMP,
    LossConfig,
    micro_batch_loss,
    prepare_correction,
    sparsity_log_ratio,
)

D = torch.float64


def test_log_rho_is_old_minus_sampler_zero_at_padding():
    old = torch.tensor([[-1.0, -0.5, 7.0]], dtype=D)
    sampler = torch.tensor([[-1.5, -0.25, float("nan")]], dtype=D)  # padding may hold NaN
    mask = torch.tensor([[1, 1, 0]])
    log_rho = sparsity_log_ratio(old, sampler, mask)
    torch.testing.assert_close(log_rho, torch.tensor([[0.5, -0.25, 0.0]], dtype=D), rtol=0, atol=0)
    # rho > 1 means the dense old policy likes the sampled token MORE than the sparse sampler did
    assert math.isclose(math.exp(log_rho[0, 0].item()), math.exp(0.5))


def test_log_rho_clamped_to_named_bound():
    assert LOG_RATIO_CLAMP == 20.0
    old = torch.tensor([[0.0, -100.0]], dtype=D)
    sampler = torch.tensor([[-100.0, 0.0]], dtype=D)
    log_rho = sparsity_log_ratio(old, sampler, torch.ones(1, 2, dtype=torch.bool))
    assert log_rho.tolist() == [[20.0, -20.0]]


def test_log_rho_inputs_are_not_modified_and_result_is_detached():
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    sampler = torch.tensor([[-1.5, -2.0]])
    before = sampler.clone()
    out = sparsity_log_ratio(old, sampler, torch.ones(1, 2))
    assert not out.requires_grad
    assert torch.equal(sampler, before)


@pytest.mark.parametrize("which", ["old", "sampler"])
def test_nan_log_prob_at_response_token_is_an_error(which):
    old = torch.tensor([[-1.0, -2.0]])
    sampler = torch.tensor([[-1.0, -2.0]])
    (old if which == "old" else sampler)[0, 1] = float("nan")
    with pytest.raises(ValueError, match=f"{which}_log_probs.*non-finite.*\\(0, 1\\)"):
        sparsity_log_ratio(old, sampler, torch.ones(1, 2))


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shape mismatch: sampler_log_probs"):
        sparsity_log_ratio(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        sparsity_log_ratio(torch.zeros(3), torch.zeros(3), torch.ones(3))


def test_rho_uses_dense_old_not_current_and_ppo_ratio_uses_current_over_old():
    """Pin the three policies. Sample 0 has rho = pi_old/pi_sparse = [1.25, 1.0] (inside [0.5, 1.5]) while
    the CURRENT policy is 1.3x the old one: the buggy ratio pi_theta/pi_sparse would be 1.625 and reject
    token 0. The PPO ratio pi_theta/pi_old = 1.3 is clipped at 1.2 for A > 0."""
    old = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], dtype=D)
    log_rho = torch.tensor([[math.log(1.25), 0.0], [0.0, 0.0]], dtype=D)
    sampler = old - log_rho
    current = (old + math.log(1.3)).requires_grad_()
    prepared = prepare_correction(old, sampler, torch.ones(2, 2), torch.tensor([1.0, 0.0], dtype=D), torch.tensor([0, 0]))
    assert prepared.loss_mask.all()  # nothing rejected: rho came from old and sampler only
    torch.testing.assert_close(prepared.log_rho, log_rho)
    # weights: raw [1.25, 1, 1, 1], normalised by 4 / 4.25
    f = 4 / 4.25
    torch.testing.assert_close(prepared.weights, torch.tensor([[1.25, 1.0], [1.0, 1.0]], dtype=D))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO on rewards [1, 0], unbiased std
    loss, metrics = micro_batch_loss(current, prepared, LossConfig())
    # A > 0: ratio 1.3 clipped to 1.2; A < 0: max(1.3 a, 1.2 a) = 1.3 a
    tok0 = [-1.2 * a * 1.25 * f, -1.2 * a * f]
    tok1 = [1.3 * a * f, 1.3 * a * f]
    expected = (sum(tok0) / 2 + sum(tok1) / 2) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["loss/clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # clipped tokens (sample 0) get no gradient; sample 1: d/dlogp (1.3 a f) / (2 * 2)
    torch.testing.assert_close(current.grad[0], torch.zeros(2, dtype=D))
    torch.testing.assert_close(current.grad[1], torch.full((2,), 1.3 * a * f / 4, dtype=D))


def test_prepare_has_no_current_log_prob_input():
    """prepare_correction cannot see pi_theta: its log-prob inputs are exactly (old, sampler)."""
    import inspect

    params = list(inspect.signature(prepare_correction).parameters)
    assert params[:2] == ["old_log_probs", "sampler_log_probs"]
    assert not any("current" in p or p == "log_probs" for p in params)
    assert CorrectionConfig().mode == "sparse_rl"
