"""The full correction + micro-batch loss: exact values, zero gradient for rejected tokens, global
denominators, split invariance (hypothesis), equality with plain GRPO when pi_sparse == pi_old, bad input."""
import math

import pytest
import torch
from algo_fixtures import ADV, FACTOR, batch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_rl_megatron.algo import (
    CorrectionConfig,
    GlobalNormalisers,
    LossConfig,
    local_normalisers,
    micro_batch_loss,
    prepare_correction,
)
from sparse_rl_megatron.utils.registry import UnknownNameError

D = torch.float64


def test_prepare_exact_tensors():
    p = prepare_correction(*batch())
    assert p.loss_mask.tolist() == [[True, False, True], [True, True, False], [False] * 3]
    assert p.keep.tolist() == [True, True, False]
    torch.testing.assert_close(p.advantages, torch.tensor([ADV, -ADV, 0.0], dtype=D), rtol=1e-15, atol=0)
    torch.testing.assert_close(p.weights, torch.tensor([[1.2, 0, 1.0], [0.6, 1.0, 0], [0, 0, 0]], dtype=D))
    assert p.normalisers == GlobalNormalisers(weight_sum=pytest.approx(3.8), kept_tokens=4, kept_seqs=2, response_tokens=8)


def test_loss_value_gradient_and_denominator():
    old, *rest = batch()
    p = prepare_correction(old, *rest)
    cur = old.clone().requires_grad_()  # ratio 1: loss_t = -A w_t
    loss, metrics = micro_batch_loss(cur, p)
    s0 = -ADV * FACTOR * (1.2 + 1.0) / 2  # mean over KEPT tokens of sample 0 (2, not 3)
    s1 = ADV * FACTOR * (0.6 + 1.0) / 2
    assert loss.item() == pytest.approx((s0 + s1) / 2, rel=1e-12)  # / kept sequences (2, not 3)
    loss.backward()
    g = cur.grad
    expected = torch.tensor([[-ADV * 1.2, 0, -ADV * 1.0], [ADV * 0.6, ADV * 1.0, 0], [0, 0, 0]], dtype=D) * FACTOR / 4
    torch.testing.assert_close(g, expected, rtol=1e-12, atol=0)
    assert g[0, 1].item() == 0.0 and torch.equal(g[2], torch.zeros(3, dtype=D))  # exactly zero
    assert metrics["loss/clip_frac"].item() == 0.0


@pytest.mark.parametrize("reduction,denominator", [("token_mean", 4), ("seq_mean_token_sum", 2)])
def test_other_reductions_use_kept_counts(reduction, denominator):
    old, *rest = batch()
    p = prepare_correction(old, *rest)
    loss, _ = micro_batch_loss(old.clone(), p, LossConfig(reduction=reduction))
    total = -ADV * FACTOR * (1.2 + 1.0) + ADV * FACTOR * (0.6 + 1.0)
    assert loss.item() == pytest.approx(total / denominator, rel=1e-12)


def test_rejected_token_values_cannot_leak_into_loss_or_gradient():
    """Whatever the current policy does on rejected / vetoed / padded tokens, loss and gradient are unchanged."""
    old, *rest = batch()
    p = prepare_correction(old, *rest)
    a = old.clone().requires_grad_()
    b = old.clone()
    b[0, 1], b[2, :], b[1, 2] = 5.0, float("nan"), float("inf")
    b.requires_grad_()
    la, _ = micro_batch_loss(a, p)
    lb, _ = micro_batch_loss(b, p)
    la.backward()
    lb.backward()
    assert la.item() == lb.item()
    assert torch.equal(a.grad, b.grad)


def test_kl_and_entropy_terms():
    old, *rest = batch()
    p = prepare_correction(old, *rest)
    ref = old - 0.5  # d = log pi - log ref = 0.5 on every token
    ent = torch.full_like(old, 2.0)
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, m = micro_batch_loss(old.clone(), p, cfg, ref_log_probs=ref, entropy=ent)
    pg = (-ADV * FACTOR * 1.1 + ADV * FACTOR * 0.8) / 2
    assert m["loss/kl"].item() == pytest.approx(0.5) and m["loss/entropy"].item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(pg + 0.1 * 0.5 - 0.01 * 2.0, rel=1e-12)
    with pytest.raises(ValueError, match="needs ref_log_probs"):
        micro_batch_loss(old.clone(), p, LossConfig(kl_coef=1e-4))
    with pytest.raises(ValueError, match="needs entropy"):
        micro_batch_loss(old.clone(), p, LossConfig(entropy_coef=1e-3))
    assert LossConfig.reference().kl_coef == 1e-4 and LossConfig.reference().kl_estimator == "low_var_kl"


def _plain_grpo_loss(cur, old, mask, rewards, groups, eps=0.2):
    """An independent GRPO: per-group (r - mean) / (unbiased std + 1e-6), PPO-clip, seq-mean-token-mean."""
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        idx = groups == g
        r = rewards[idx]
        std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
        adv[idx] = (r - r.mean()) / (std + 1e-6)
    ratio = torch.exp(cur - old)
    a = adv[:, None]
    tok = torch.maximum(-ratio * a, -ratio.clamp(1 - eps, 1 + eps) * a) * mask
    return (tok.sum(-1) / mask.sum(-1)).sum() / mask.shape[0]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(["sparse_rl", "rejection_only", "reweight_only"]))
def test_pi_sparse_equal_pi_old_gives_plain_grpo_exactly(seed, mode):
    g = torch.Generator().manual_seed(seed)
    b, t = 8, 5
    old = -torch.rand(b, t, generator=g, dtype=D) * 3
    cur = (old + torch.randn(b, t, generator=g, dtype=D) * 0.3).requires_grad_()
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, 3:] = torch.rand(b, 2, generator=g) < 0.5
    rewards = torch.randint(0, 2, (b,), generator=g).to(D)
    groups = torch.arange(b) // 4
    corrected = prepare_correction(old, old.clone(), mask, rewards, groups, CorrectionConfig(mode=mode))
    plain = prepare_correction(old, None, mask, rewards, groups, CorrectionConfig(mode="none"))
    assert corrected.loss_mask.equal(mask) and corrected.metrics["sparse/weight_norm_factor"] == 1.0
    l1, _ = micro_batch_loss(cur, corrected)
    (g1,) = torch.autograd.grad(l1, cur)
    l2, _ = micro_batch_loss(cur, plain)
    (g2,) = torch.autograd.grad(l2, cur)
    assert l1.item() == l2.item() and torch.equal(g1, g2)  # bit-exact
    l3 = _plain_grpo_loss(cur, old, mask.to(D), rewards, groups)
    torch.testing.assert_close(l1, l3, rtol=1e-12, atol=1e-15)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    length=st.integers(1, 6),
    num_micro=st.sampled_from([1, 2, 4]),
    mode=st.sampled_from(["sparse_rl", "rejection_only", "reweight_only", "none"]),
    weight_mode=st.sampled_from(["truncate", "mask", "clip"]),
    level=st.sampled_from(["token", "sequence", "geometric"]),
    reduction=st.sampled_from(["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"]),
)
def test_micro_batch_split_gives_same_weights_and_total_gradient(
    seed, length, num_micro, mode, weight_mode, level, reduction
):
    g = torch.Generator().manual_seed(seed)
    b = 8
    old = -torch.rand(b, length, generator=g, dtype=D) * 3
    noise = torch.randn(b, length, generator=g, dtype=D) * 0.5
    noise[torch.rand(b, length, generator=g) < 0.05] = -12.0  # occasional vetoed token
    sampler = old - noise
    mask = torch.rand(b, length, generator=g) < 0.8
    rewards = torch.randint(0, 2, (b,), generator=g).to(D)
    groups = torch.arange(b) // 4
    cur = (old + torch.randn(b, length, generator=g, dtype=D) * 0.2).detach()
    cfg = CorrectionConfig(mode=mode, weight_mode=weight_mode, rejection_level=level)
    loss_cfg = LossConfig(reduction=reduction, kl_coef=0.01, entropy_coef=0.001)
    ref = old - 0.1
    ent = torch.rand(b, length, generator=g, dtype=D)
    p = prepare_correction(old, sampler, mask, rewards, groups, cfg)

    def total_grad(parts):
        x = cur.clone().requires_grad_()
        total = torch.zeros((), dtype=D)
        for idx, part in parts:
            loss, _ = micro_batch_loss(x[idx], part, loss_cfg, ref_log_probs=ref[idx], entropy=ent[idx])
            loss.backward()  # gradients accumulate across micro-batches
            total = total + loss.detach()
        return total, x.grad

    full_loss, full_grad = total_grad([(slice(None), p)])
    bounds = [i * b // num_micro for i in range(num_micro + 1)]
    slices = [slice(bounds[i], bounds[i + 1]) for i in range(num_micro)]
    parts = p.micro_batches(num_micro)
    # the normalisers rebuilt from per-micro-batch parts (as an all-reduce would) equal the global ones
    rebuilt = sum((local_normalisers(q.loss_mask, q.response_mask, q.weights) for q in parts[1:]),
                  local_normalisers(parts[0].loss_mask, parts[0].response_mask, parts[0].weights))
    assert rebuilt.as_tensor().tolist() == pytest.approx(p.normalisers.as_tensor().tolist(), rel=1e-14)
    split_loss, split_grad = total_grad(list(zip(slices, parts)))
    torch.testing.assert_close(split_loss, full_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-14)
    assert torch.isfinite(full_grad).all()


def test_empty_masks_give_zero_loss_not_nan():
    old = torch.full((2, 3), -1.0, dtype=D)
    p = prepare_correction(old, old.clone(), torch.zeros(2, 3), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    assert p.keep.tolist() == [False, False] and p.advantages.tolist() == [0.0, 0.0]
    assert p.metrics["sparse/rejected_seq_frac"] == 0.0 and p.metrics["sparse/num_seqs"] == 0.0
    cur = old.clone().requires_grad_()
    loss, metrics = micro_batch_loss(cur, p)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(cur.grad, torch.zeros_like(old))
    assert all(math.isfinite(v.item()) for v in metrics.values())


def test_everything_rejected_gives_zero_loss():
    old = torch.full((2, 2), -1.0, dtype=D)
    p = prepare_correction(old, old + 12.0, torch.ones(2, 2), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    assert p.metrics["sparse/rejected_seq_frac"] == 1.0 and p.metrics["sparse/vetoed_seq_frac"] == 1.0
    loss, _ = micro_batch_loss(old.clone().requires_grad_(), p)
    assert loss.item() == 0.0


def test_bad_input_errors():
    old, sampler, mask, rewards, groups = batch()
    with pytest.raises(ValueError, match="shape mismatch: sampler_log_probs"):
        prepare_correction(old, sampler[:, :2], mask, rewards, groups)
    with pytest.raises(ValueError, match=r"rewards must have shape \[B\]"):
        prepare_correction(old, sampler, mask, rewards[:2], groups)
    bad = old.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="old_log_probs has 1 non-finite"):
        prepare_correction(bad, sampler, mask, rewards, groups)
    with pytest.raises(ValueError, match="needs sampler_log_probs"):
        prepare_correction(old, None, mask, rewards, groups)
    with pytest.raises(ValueError, match="empty rollout batch"):
        prepare_correction(old[:0], sampler[:0], mask[:0], rewards[:0], groups[:0])
    p = prepare_correction(old, sampler, mask, rewards, groups)
    cur = old.clone()
    cur[1, 0] = float("nan")  # a kept token
    with pytest.raises(ValueError, match="log_probs has 1 non-finite"):
        micro_batch_loss(cur, p)
    with pytest.raises(ValueError, match="shape mismatch"):
        micro_batch_loss(old[:, :2], p)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "sparse"}, "CorrectionConfig.mode: unknown correction mode 'sparse'; valid names: custom, none, "
                              "rejection_only, reweight_only, sparse_rl"),
        ({"rejection_level": "x"}, "CorrectionConfig.rejection_level"),
        ({"weight_mode": "x"}, "CorrectionConfig.weight_mode"),
        ({"advantage_estimator": "x"}, "CorrectionConfig.advantage_estimator"),
    ],
)
def test_unknown_names_in_config(kwargs, match):
    with pytest.raises(UnknownNameError, match=match):
        CorrectionConfig(**kwargs)


def test_config_validation():
    with pytest.raises(ValueError, match="rejection_max_divergence"):
        CorrectionConfig(rejection_key="k3")
    with pytest.raises(ValueError, match="veto_threshold"):
        CorrectionConfig(veto_threshold=1.5)
    with pytest.raises(ValueError, match="hook must be a dotted path"):
        CorrectionConfig(mode="custom")
    with pytest.raises(ValueError, match="only used with mode='custom'"):
        CorrectionConfig(hook="a.b")
    with pytest.raises(UnknownNameError, match="LossConfig.reduction"):
        LossConfig(reduction="sum")
    with pytest.raises(ValueError, match="LossConfig.eps_clip_low"):
        LossConfig(eps_clip_low=1.0)
    c = CorrectionConfig()
    assert (c.veto_threshold, c.rejection_lower, c.rejection_upper, c.weight_mode, c.weight_upper) == (
        1e-4, 0.5, 1.5, "truncate", 1.5)
