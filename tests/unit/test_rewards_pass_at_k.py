"""pass@k (unbiased estimator), avg@k and the per-benchmark metrics built from verdicts."""
from math import comb

import pytest

from sparse_rl_megatron.eval.metrics import avg_at_k, default_ks, mean_pass_at_k, pass_at_k
from sparse_rl_megatron.eval.runner import benchmark_metrics


@pytest.mark.parametrize("n, c, k", [(1, 0, 1), (1, 1, 1), (4, 1, 1), (4, 1, 2), (4, 2, 3), (8, 3, 4),
                                     (32, 5, 8), (32, 0, 32), (32, 31, 2), (10, 7, 4)])
def test_pass_at_k_equals_the_binomial_formula(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # one of four samples right: pass@1 = c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)   # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 3, 2) == 1.0                  # any 2 of 4 contain a correct one
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(2, 3, 1)


def test_avg_and_mean_pass_over_problems():
    correct = [[True, False, False, False], [True, True, True, True], [False] * 4]
    assert avg_at_k(correct) == pytest.approx((0.25 + 1 + 0) / 3)
    assert mean_pass_at_k(correct, 1) == pytest.approx(avg_at_k(correct))  # pass@1 == avg@n
    assert mean_pass_at_k(correct, 2) == pytest.approx((0.5 + 1 + 0) / 3)
    assert default_ks(32) == [1, 2, 4, 8, 16, 32] and default_ks(1) == [1] and default_ks(6) == [1, 2, 4, 6]


def test_benchmark_metrics_from_samples():
    def s(reason, tokens=10, finish="eos", events=0, peak=5):
        return {"reason": reason, "response_tokens": tokens, "finish_reason": finish,
                "compression_events": events, "peak_kv_tokens": peak}

    correct = [[True, False], [False, False]]
    samples = [s("correct"), s("wrong", 20, "length", 2, 9), s("no_answer", 30), s("timeout", 40, events=2)]
    m = benchmark_metrics(correct, samples, ks=[1, 2, 4])
    assert m["avg@2"] == pytest.approx(0.25) and m["pass@1"] == pytest.approx(0.25)
    assert m["pass@2"] == pytest.approx(0.5) and "pass@4" not in m  # k > n is left out
    assert m["reasons"] == {"correct": 1, "wrong": 1, "no_answer": 1, "timeout": 1, "parse_error": 0}
    assert (m["mean_response_tokens"], m["truncated_fraction"], m["mean_compression_events"],
            m["max_peak_kv_tokens"]) == (25.0, 0.25, 1.0, 9)
