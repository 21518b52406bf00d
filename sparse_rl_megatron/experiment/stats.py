"""Paired per-seed statistics of the pre-registered decision rules (docs/experiments.md): t intervals, the exact
sign-flip (randomisation) test, Holm's step-down adjustment. Standard library only.

A comparison of two arms is the list of per-seed differences ``d_s`` (the arms of a seed share its warm start,
prompt order and sampler seeds, so the pairs are matched). Under the null of no difference (or of a difference
equal to ``margin``) each ``d_s - margin`` is symmetric about 0, so every one of the 2^n sign patterns is equally
likely: the exact p-value is the share of patterns whose mean is at least as extreme as the observed one.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Sequence

ALTERNATIVES = ("greater", "less", "two-sided")
TIE_TOLERANCE = 1e-12
"""Means this close count as equal (ties are counted as extreme, so the test stays exact)."""
MAX_EXACT_N = 20
"""Largest n enumerated exactly (2^20 patterns)."""


def t_cdf(t: float, df: int) -> float:
    """Student's t CDF for a whole number of degrees of freedom (Abramowitz & Stegun 26.7.3-4)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"t_cdf needs whole df >= 1, got {df}")
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df == 1:
        a = 2 * theta / math.pi
    elif df % 2:  # odd: (2/pi)(theta + sin cos (1 + 2/3 cos^2 + 2.4/3.5 cos^4 + ...))
        term, total = c, c
        for k in range(1, (df - 3) // 2 + 1):
            term *= c * c * (2 * k) / (2 * k + 1)
            total += term
        a = 2 / math.pi * (theta + s * total)
    else:  # even: sin (1 + 1/2 cos^2 + 1.3/2.4 cos^4 + ...)
        term, total = 1.0, 1.0
        for k in range(1, (df - 2) // 2 + 1):
            term *= c * c * (2 * k - 1) / (2 * k)
            total += term
        a = s * total
    return 0.5 + 0.5 * a  # a = P(|T| < |t|) signed by t


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on ``t_cdf``)."""
    if not 0 < p < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1, got {p}")
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def sign_flip_p(diffs: Sequence[float], alternative: str = "greater", margin: float = 0.0) -> float:
    """Exact sign-flip p-value of ``mean(diffs) - margin`` against 0 (``greater``: H1 mean > margin)."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {', '.join(ALTERNATIVES)}, got '{alternative}'")
    x = [d - margin for d in diffs]
    n = len(x)
    if not 1 <= n <= MAX_EXACT_N:
        raise ValueError(f"sign_flip_p enumerates 2^n patterns; needs 1 <= n <= {MAX_EXACT_N}, got {n}")
    observed = sum(x) / n
    hits = 0
    for signs in itertools.product((1, -1), repeat=n):
        m = sum(s * v for s, v in zip(signs, x)) / n
        if alternative == "greater":
            hits += m >= observed - TIE_TOLERANCE
        elif alternative == "less":
            hits += m <= observed + TIE_TOLERANCE
        else:
            hits += abs(m) >= abs(observed) - TIE_TOLERANCE
    return hits / 2 ** n


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (family-wise error control), by name."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m, running, out = len(order), 0.0, {}
    for i, name in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[name]))
        out[name] = running
    return out


@dataclass
class PairedSummary:
    """One paired comparison over seeds (all in the units of ``diffs``, e.g. accuracy points)."""

    n: int
    mean: float
    sd: float
    """Sample standard deviation of the differences (NaN for n = 1)."""
    ci_low: float
    """Two-sided 95% t interval."""
    ci_high: float
    bound: float
    """One-sided 95% t bound in the direction of ``alternative`` (lower for greater, upper for less)."""
    p_sign_flip: float
    """Exact one-sided (or two-sided) sign-flip p-value against ``margin``."""
    margin: float
    alternative: str
    diffs: list[float]

    def as_dict(self) -> dict:
        return asdict(self)


def paired_summary(diffs: Sequence[float], alternative: str = "greater", margin: float = 0.0) -> PairedSummary:
    """Mean, sd, 95% t interval, one-sided 95% t bound and the exact sign-flip p-value of ``diffs``."""
    diffs = [float(d) for d in diffs]
    n = len(diffs)
    if n == 0:
        raise ValueError("paired_summary needs at least one difference")
    mean = sum(diffs) / n
    if n < 2:
        nan = math.nan
        return PairedSummary(n, mean, nan, nan, nan, nan, sign_flip_p(diffs, alternative, margin), margin,
                             alternative, diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    se = sd / math.sqrt(n)
    half = t_quantile(0.975, n - 1) * se
    one = t_quantile(0.95, n - 1) * se
    bound = mean - one if alternative == "greater" else mean + one if alternative == "less" else math.nan
    return PairedSummary(n, mean, sd, mean - half, mean + half, bound, sign_flip_p(diffs, alternative, margin),
                         margin, alternative, diffs)
