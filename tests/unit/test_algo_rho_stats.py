"""rho distribution statistics and shared-edge histograms of a budget study (hand-worked values)."""
import math

import pytest
import torch
from algo_fixtures import batch

from sparse_rl_megatron.algo import prepare_correction
from sparse_rl_megatron.algo.rho_stats import SUMMARY_KEYS, histogram_counts, histogram_edges, rho_summary

L = math.log
GARBAGE = 123.0  # padding values are never read


def _example():
    log_rho = torch.tensor([[0.0, L(0.5), L(2.0), GARBAGE],
                            [L(1e-4), 0.0, GARBAGE, float("nan")],
                            [GARBAGE, GARBAGE, GARBAGE, GARBAGE]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    return log_rho, mask


def test_rho_summary_exact():
    s = rho_summary(*_example())
    assert list(s) == list(SUMMARY_KEYS)
    ordered = [1e-4, 0.5, 1.0, 1.0, 2.0]  # the 5 response tokens' rho, sorted; quantile position q * 4
    approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-15)  # noqa: E731
    assert s["rho/min"] == approx(1e-4) and s["rho/max"] == approx(2.0)
    assert s["rho/p0.1"] == approx(1e-4 + 0.004 * (0.5 - 1e-4))
    assert s["rho/p1"] == approx(1e-4 + 0.04 * (0.5 - 1e-4))
    assert s["rho/p5"] == approx(1e-4 + 0.2 * (0.5 - 1e-4))
    assert s["rho/p50"] == approx(1.0)
    assert s["rho/p99"] == approx(1.0 + 0.96 * (2.0 - 1.0))
    assert s["rho/mean"] == approx(sum(ordered) / 5)
    assert s["log_rho/abs_mean"] == approx((2 * L(2.0) + L(1e4)) / 5)
    assert s["log_rho/abs_max"] == approx(L(1e4))
    # per sequence: L(0.5) + L(2) = 0 and L(1e-4); the empty third row is no sequence
    assert s["log_rho/seq_sum_mean"] == approx(L(1e-4) / 2)
    assert s["log_rho/seq_sum_min"] == approx(L(1e-4))


def test_rho_summary_of_a_consistent_engine_and_of_nothing():
    zeros = torch.zeros(2, 3)
    s = rho_summary(zeros, torch.ones(2, 3, dtype=torch.bool))
    assert all(s[k] == 1.0 for k in SUMMARY_KEYS if k.startswith("rho/"))
    assert all(s[k] == 0.0 for k in SUMMARY_KEYS if k.startswith("log_rho/"))
    empty = rho_summary(zeros, torch.zeros(2, 3, dtype=torch.bool))
    assert list(empty) == list(SUMMARY_KEYS) and all(math.isnan(v) for v in empty.values())
    with pytest.raises(ValueError, match="mask has shape"):
        rho_summary(zeros, torch.ones(2, 2, dtype=torch.bool))


def test_rho_summary_agrees_with_the_training_metrics():
    p = prepare_correction(*batch())
    s = rho_summary(p.log_rho, p.response_mask)
    for name in ("min", "max", "mean", "p1", "p5", "p50"):
        assert s[f"rho/{name}"] == pytest.approx(p.metrics[f"sparse/rho_{name}"], rel=1e-12)


def test_histogram_shared_edges_and_exact_counts():
    edges = histogram_edges([torch.tensor([0.0, 3.0]), torch.tensor([-1.0]), torch.tensor([])], bins=4)
    assert edges.tolist() == [-1.0, 0.0, 1.0, 2.0, 3.0]
    # [e_i, e_i+1) bins, the last one closed; values outside the edges are not counted
    assert histogram_counts(torch.tensor([-1.0, 0.0, 0.5, 1.999, 3.0, 3.5, -2.0]), edges) == [1, 2, 1, 1]
    assert histogram_counts(torch.tensor([[2.0, 2.0], [2.5, 0.0]]), edges) == [0, 1, 0, 3]


def test_histogram_of_equal_values_has_a_minimum_span():
    edges = histogram_edges([torch.zeros(5)], bins=2)
    assert edges.tolist() == pytest.approx([-5e-7, 0.0, 5e-7], abs=1e-18)
    assert histogram_counts(torch.zeros(5), edges) == [0, 5]
    assert histogram_edges([], bins=2).tolist() == pytest.approx([-5e-7, 0.0, 5e-7], abs=1e-18)
    with pytest.raises(ValueError, match="finite"):
        histogram_edges([torch.tensor([0.0, math.inf])], bins=2)
    with pytest.raises(ValueError, match="bins must be >= 1"):
        histogram_edges([torch.zeros(1)], bins=0)
