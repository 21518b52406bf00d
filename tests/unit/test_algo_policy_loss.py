"""PPO-clip, KL estimators, entropy and reductions on hand-worked tensors."""
import math

import pytest
import torch

from sparse_rl_megatron.algo import (
    entropy_from_logits,
    kl_penalty,
    local_denominator,
    ppo_clip_loss,
    reduce_loss,
)
from sparse_rl_megatron.utils.registry import UnknownNameError

D = torch.float64


def test_ppo_clip_values_and_clip_fraction():
    ratios = [1.5, 1.5, 0.5, 0.5, 1.0]
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]], dtype=D)
    old = torch.full((1, 5), -1.0, dtype=D)
    cur = (old + torch.tensor([[math.log(r) for r in ratios]], dtype=D)).requires_grad_()
    loss, clipped = ppo_clip_loss(cur, old, adv, torch.ones(1, 5))
    # max(-rA, -clip(r, 0.8, 1.2) A)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 1.5, -0.5, 0.8, -2.0]], dtype=D))
    assert clipped.tolist() == [[True, False, False, True, False]]
    loss.sum().backward()
    # d(-r A)/dlog pi = -r A on the unclipped branch, 0 on the clipped one
    torch.testing.assert_close(cur.grad, torch.tensor([[0.0, 1.5, -0.5, 0.0, -2.0]], dtype=D))


def test_ppo_clip_asymmetric_eps_weights_and_mask():
    old = torch.zeros(1, 3, dtype=D)
    cur = torch.tensor([[math.log(1.25), math.log(1.25), float("nan")]], dtype=D, requires_grad=True)
    adv = torch.tensor([1.0], dtype=D)  # [B] advantages broadcast over tokens
    weights = torch.tensor([[2.0, 1.0, float("nan")]], dtype=D)
    loss, clipped = ppo_clip_loss(cur, old, adv, torch.tensor([[1, 1, 0]]), eps_high=0.28, weights=weights)
    torch.testing.assert_close(loss, torch.tensor([[-2.5, -1.25, 0.0]], dtype=D))
    assert not clipped.any()
    loss.sum().backward()
    assert torch.isfinite(cur.grad).all() and cur.grad[0, 2].item() == 0.0
    with pytest.raises(ValueError, match="eps_low"):
        ppo_clip_loss(cur, old, adv, torch.ones(1, 3), eps_low=1.0)


def test_kl_estimators():
    lp = torch.tensor([[0.5, -30.0, 9.0]], dtype=D)
    ref = torch.zeros(1, 3, dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k1"), torch.tensor([[0.5, -30.0, 0.0]], dtype=D))
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k2"), torch.tensor([[0.125, 450.0, 0.0]], dtype=D))
    k3 = kl_penalty(lp, ref, mask, "low_var_kl")
    # exp(-d) - 1 + d; for d = -30 the log-ratio is clamped to 20 and the estimate to 10
    torch.testing.assert_close(k3, torch.tensor([[math.exp(-0.5) - 0.5, 10.0, 0.0]], dtype=D))
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k3"), k3)
    with pytest.raises(UnknownNameError, match="valid names: k1, k2, k3, low_var_kl"):
        kl_penalty(lp, ref, mask, "mse")


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    h = entropy_from_logits(logits)
    assert h[0].item() == pytest.approx(math.log(4))
    assert h[1].item() == pytest.approx(0.0, abs=1e-6)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0], [5.0, 5.0, 5.0]], dtype=D)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "name,denom,expected",
    [
        ("seq_mean_token_mean", 2, (1.5 + 4.0) / 2),
        ("token_mean", 3, 7.0 / 3),
        ("seq_mean_token_sum", 2, 7.0 / 2),
    ],
)
def test_reductions_exact(name, denom, expected):
    assert local_denominator(name, MASK).item() == denom  # the empty row 3 counts in no denominator
    assert reduce_loss(name, VALUES, MASK, denom).item() == pytest.approx(expected)
    # with a larger GLOBAL denominator the micro-batch returns its share
    assert reduce_loss(name, VALUES, MASK, 10).item() == pytest.approx(expected * denom / 10)


def test_reduction_of_empty_global_batch_is_zero_with_zero_grad():
    values = torch.ones(2, 2, dtype=D, requires_grad=True)
    out = reduce_loss("seq_mean_token_mean", values, torch.zeros(2, 2), 0)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(values.grad, torch.zeros(2, 2, dtype=D))
    with pytest.raises(UnknownNameError, match="valid names: seq_mean_token_mean, seq_mean_token_sum, token_mean"):
        reduce_loss("mean", values, torch.ones(2, 2), 1)
    with pytest.raises(ValueError, match="global_denominator"):
        reduce_loss("token_mean", values, torch.ones(2, 2), float("nan"))
