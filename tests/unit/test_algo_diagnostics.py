"""Rollout diagnostics in every correction mode (hand-worked batch of algo_fixtures, plus length bins)."""
import math

import pytest
import torch
from algo_fixtures import RHO, batch

from sparse_rl_megatron.algo import CorrectionConfig, prepare_correction
from sparse_rl_megatron.algo.diagnostics import (
    LENGTH_BIN_EDGES,
    WOULD_VETO_THRESHOLD,
    length_bin,
    rollout_diagnostics,
    would_veto,
)

D = torch.float64


@pytest.mark.parametrize("mode", ["none", "sparse_rl", "reweight_only"])
def test_would_veto_is_computed_whatever_the_mode(mode):
    m = prepare_correction(*batch(), CorrectionConfig(mode=mode)).metrics
    assert m["sparse/would_veto_frac"] == pytest.approx(1 / 3)  # sample 2 has rho 5e-5 < 1e-4
    assert m["sparse/reward_mean_would_veto"] == pytest.approx(1.0)  # sample 2's reward
    assert m["sparse/reward_mean_would_keep"] == pytest.approx(0.5)  # samples 0, 1: rewards 1, 0
    # what the correction really dropped: sample 2 with sparse_rl, nothing otherwise
    assert m["sparse/vetoed_seq_frac"] == pytest.approx(1 / 3 if mode == "sparse_rl" else 0.0)
    if mode == "sparse_rl":
        assert m["sparse/reward_mean_kept"] == pytest.approx(0.5)
        assert m["sparse/reward_mean_rejected"] == pytest.approx(1.0)
    else:
        assert m["sparse/reward_mean_kept"] == pytest.approx(2 / 3)
        assert math.isnan(m["sparse/reward_mean_rejected"])


def test_length_bins_of_the_fixture():
    m = prepare_correction(*batch(), CorrectionConfig(mode="none")).metrics
    assert m["sparse/would_veto_frac/len_0_32"] == pytest.approx(1 / 3)  # all three responses are 2-3 tokens
    assert m["sparse/seq_frac/len_0_32"] == pytest.approx(1.0)
    assert not [k for k in m if k.startswith("sparse/seq_frac/") and k != "sparse/seq_frac/len_0_32"]


def test_entropies_exact():
    old, sampler, mask, rewards, _ = batch()
    m = prepare_correction(*batch(), CorrectionConfig(mode="none")).metrics
    rhos = [r for row, n in zip(RHO, (3, 2, 3)) for r in row[:n]]
    # sampler log-prob = -1 - log rho at every response token
    assert m["sparse/entropy_sampler"] == pytest.approx(sum(1 + math.log(r) for r in rhos) / 8)
    # pi_old's log-prob is -1 everywhere: the self-normalised IS estimate is exactly 1
    assert m["sparse/entropy_dense"] == pytest.approx(1.0)


def test_length_bins_split_the_veto_rate_and_dense_entropies_coincide():
    # 4 samples: lengths 40, 40, 70, 70 (T = 70); one vetoed token in a short and in both long responses
    t = 70
    mask = torch.zeros(4, t, dtype=torch.bool)
    mask[0, :40] = mask[1, :40] = True
    mask[2:, :] = True
    old = torch.full((4, t), -0.5, dtype=D)
    log_rho = torch.zeros(4, t, dtype=D)
    log_rho[0, 10] = log_rho[2, 60] = log_rho[3, 0] = math.log(1e-5)
    log_rho[1, 50] = math.log(1e-9)  # padding: must not count
    m = rollout_diagnostics(log_rho=log_rho, old_log_probs=old, sampler_log_probs=old - log_rho,
                            response_mask=mask, keep=torch.ones(4, dtype=torch.bool),
                            rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), veto_threshold=None)
    assert m["sparse/would_veto_frac"] == pytest.approx(3 / 4)
    assert m["sparse/would_veto_frac/len_32_64"] == pytest.approx(1 / 2)
    assert m["sparse/would_veto_frac/len_64_128"] == pytest.approx(1.0)
    assert m["sparse/seq_frac/len_32_64"] == m["sparse/seq_frac/len_64_128"] == pytest.approx(0.5)
    assert m["sparse/reward_mean_would_veto"] == pytest.approx(1 / 3)
    assert m["sparse/reward_mean_would_keep"] == pytest.approx(0.0)
    # no mismatch: both entropy estimates are the mean NLL, 0.5
    dense = rollout_diagnostics(log_rho=torch.zeros(4, t, dtype=D), old_log_probs=old, sampler_log_probs=old,
                                response_mask=mask, keep=torch.ones(4, dtype=torch.bool),
                                rewards=torch.zeros(4), veto_threshold=1e-4)
    assert dense["sparse/entropy_sampler"] == pytest.approx(0.5) == dense["sparse/entropy_dense"]
    assert dense["sparse/would_veto_frac"] == 0.0


def test_entropy_estimate_is_unbiased_at_temperature_one():
    # samples of a fixed categorical: mean -log p(y) -> H(p); IS-weighted NLL of another policy -> H(q)
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.7, 0.2, 0.1], dtype=D)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=D)
    y = torch.multinomial(p, 200_000, replacement=True, generator=gen).view(1000, 200)
    lp, lq = p.log()[y], q.log()[y]
    m = rollout_diagnostics(log_rho=lq - lp, old_log_probs=lq, sampler_log_probs=lp,
                            response_mask=torch.ones_like(y, dtype=torch.bool), keep=torch.ones(1000, dtype=torch.bool),
                            rewards=torch.zeros(1000), veto_threshold=None)
    assert m["sparse/entropy_sampler"] == pytest.approx(float(-(p * p.log()).sum()), abs=3e-3)
    assert m["sparse/entropy_dense"] == pytest.approx(float(-(q * q.log()).sum()), abs=1e-2)


def test_helpers():
    assert length_bin(0) == "len_0_32" and length_bin(63) == "len_32_64" and length_bin(64) == "len_64_128"
    assert length_bin(LENGTH_BIN_EDGES[-1] + 5) == f"len_{LENGTH_BIN_EDGES[-1]}_inf"
    with pytest.raises(ValueError, match="length"):
        length_bin(-1)
    lr = torch.tensor([[math.log(WOULD_VETO_THRESHOLD) - 1e-9, 0.0], [math.log(0.5), 0.0]], dtype=D)
    assert would_veto(lr, torch.ones(2, 2, dtype=torch.bool), None).tolist() == [True, False]
    assert would_veto(lr, torch.ones(2, 2, dtype=torch.bool), 0.6).tolist() == [True, True]
    with pytest.raises(ValueError, match="veto threshold"):
        would_veto(lr, torch.ones(2, 2, dtype=torch.bool), 1.5)


def test_contaminated_frac_counts_any_token_below_one_half():
    # rows: min rho 0.3 (contaminated, not vetoed), 0.6 (clean), 5e-5 (both), an empty row (not counted)
    rho = [[0.3, 1.0], [0.6, 1.0], [1.0, 5e-5], [1.0, 1.0]]
    log_rho = torch.tensor([[math.log(r) for r in row] for row in rho], dtype=D)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 0]])
    m = rollout_diagnostics(log_rho=log_rho, old_log_probs=torch.zeros(4, 2, dtype=D),
                            sampler_log_probs=-log_rho, response_mask=mask, keep=torch.ones(4, dtype=torch.bool),
                            rewards=torch.zeros(4, dtype=D), veto_threshold=1e-4)
    assert m["sparse/contaminated_frac"] == pytest.approx(2 / 3)
    assert m["sparse/would_veto_frac"] == pytest.approx(1 / 3)
    assert prepare_correction(*batch(), CorrectionConfig()).metrics["sparse/contaminated_frac"] == pytest.approx(1 / 3)
