"""Benchmark metrics from per-sample correctness: avg@k and the unbiased pass@k estimator.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with n samples of a
problem of which c are correct, the probability that at least one of k samples drawn without replacement is
correct is ``1 - C(n - c, k) / C(n, k)``; averaged over problems. avg@k is the mean correctness over the
k samples of each problem, averaged over problems (the paper's AIME24 / AMC23 "avg@32").
"""
from __future__ import annotations

from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples, ``c`` of them correct (needs 1 <= k <= n).

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, which equals ``1 - C(n-c, k) / C(n, k)`` without
    the huge binomials.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems; ``correct[p]`` holds the verdicts of problem p's samples."""
    if not correct:
        raise ValueError("mean_pass_at_k: no problems")
    return sum(pass_at_k(len(c), sum(c), k) for c in correct) / len(correct)


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Mean correctness over each problem's samples, averaged over problems (avg@n)."""
    if not correct or any(len(c) == 0 for c in correct):
        raise ValueError("avg_at_k: every problem needs at least one sample")
    return sum(sum(c) / len(c) for c in correct) / len(correct)


def default_ks(n: int) -> list[int]:
    """The k values reported by default: 1, the powers of two below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(n)
    return ks
