"""Rollout metrics on the UNMODIFIED masks (hand-worked batch of algo_fixtures)."""
import math

import pytest
import torch
from algo_fixtures import FACTOR, RHO, batch

from sparse_rl_megatron.algo import prepare_correction
from sparse_rl_megatron.algo.metrics import effective_sample_size, masked_quantiles

D = torch.float64


def test_mismatch_metrics_exact():
    m = prepare_correction(*batch()).metrics
    rhos = [r for row, n in zip(RHO, (3, 2, 3)) for r in row[:n]]  # the 8 response tokens
    assert m["sparse/num_seqs"] == 3
    assert m["sparse/rejected_seq_frac"] == pytest.approx(1 / 3)  # the vetoed sample, not 0 and not 2/3
    assert m["sparse/vetoed_seq_frac"] == pytest.approx(1 / 3)
    assert m["sparse/rejected_token_frac"] == pytest.approx(4 / 8)  # 1 out-of-bounds + 3 vetoed
    assert m["sparse/token_below_frac"] == pytest.approx(1 / 8)  # 5e-5 (0.6 is inside [0.5, 1.5])
    assert m["sparse/token_above_frac"] == pytest.approx(1 / 8)  # 2.0
    assert m["sparse/truncated_frac"] == pytest.approx(1 / 8)
    assert m["sparse/rho_mean"] == pytest.approx(sum(rhos) / 8)
    assert m["sparse/rho_min"] == pytest.approx(5e-5) and m["sparse/rho_max"] == pytest.approx(2.0)
    s = sorted(rhos)
    assert m["sparse/rho_p1"] == pytest.approx(s[0] + 0.07 * (s[1] - s[0]))  # position 0.01 * 7
    assert m["sparse/rho_p5"] == pytest.approx(s[0] + 0.35 * (s[1] - s[0]))
    assert m["sparse/rho_p50"] == pytest.approx(1.0)
    assert m["sparse/kl_k1"] == pytest.approx(sum(-math.log(r) for r in rhos) / 8)
    assert m["sparse/kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in rhos) / 8)
    assert m["sparse/kl_old_sparse_k1"] == pytest.approx(sum(r * math.log(r) for r in rhos) / 8)
    assert m["sparse/kl_old_sparse_k3"] == pytest.approx(sum(1 - r + r * math.log(r) for r in rhos) / 8)
    assert m["sparse/kl_old_sparse_k3"] > 0
    assert m["sparse/log_ppl_old"] == pytest.approx(1.0)
    assert m["sparse/log_ppl_sparse"] == pytest.approx(1.0 + sum(math.log(r) for r in rhos) / 8)
    assert m["sparse/log_ppl_diff"] == pytest.approx(m["sparse/log_ppl_old"] - m["sparse/log_ppl_sparse"])
    assert m["sparse/weight_mean"] == pytest.approx(3.8 / 4)
    assert m["sparse/weight_norm_factor"] == pytest.approx(FACTOR)
    assert m["sparse/ess"] == pytest.approx(3.8**2 / (4 * (1.44 + 1 + 0.36 + 1)))
    assert m["sparse/kept_seqs"] == 2 and m["sparse/kept_tokens"] == 4


def test_loss_metrics_clip_fraction_on_kept_and_on_all_tokens():
    from sparse_rl_megatron.algo import micro_batch_loss

    old, *rest = batch()
    p = prepare_correction(old, *rest)
    cur = old + math.log(1.5)  # ratio 1.5: clipped where A > 0 (sample 0, and vetoed sample 2 has A = 0)
    _, metrics = micro_batch_loss(cur, p)
    assert metrics["loss/clip_frac"].item() == pytest.approx(2 / 4)  # sample 0's 2 kept tokens of 4
    assert metrics["loss/clip_frac_all_tokens"].item() == pytest.approx(3 / 8)  # sample 0's 3 of 8
    assert metrics["loss/ppo_kl"].item() == pytest.approx(-math.log(1.5))
    # split in two micro-batches, the SUM of the metrics is the global value
    parts = p.micro_batches(2)
    summed = sum(micro_batch_loss(cur[i], q)[1]["loss/clip_frac"] for i, q in zip([slice(0, 2), slice(2, 3)], parts))
    assert summed.item() == pytest.approx(0.5)


def test_metric_helpers():
    v = torch.tensor([[3.0, 1.0, 2.0, 100.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]])
    assert masked_quantiles(v, mask, (0.0, 0.5, 1.0, 0.25)) == [1.0, 2.0, 3.0, 1.5]
    assert all(math.isnan(x) for x in masked_quantiles(v, torch.zeros(1, 4), (0.5,)))
    assert effective_sample_size(torch.ones(1, 4), torch.ones(1, 4)) == 1.0
    assert effective_sample_size(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.ones(1, 4)) == 0.25
    assert math.isnan(effective_sample_size(torch.ones(1, 4), torch.zeros(1, 4)))
