"""The decision rules' statistics: t quantiles, exact sign-flip test, Holm (standard library only)."""
import itertools
import math

import pytest

from sparse_rl_megatron.experiment.stats import holm, paired_summary, sign_flip_p, t_cdf, t_quantile


@pytest.mark.parametrize("p,df,want", [(0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 7, 2.364624),
                                       (0.95, 7, 1.894579), (0.975, 30, 2.042272), (0.95, 4, 2.131847)])
def test_t_quantiles_match_the_tables(p, df, want):
    assert t_quantile(p, df) == pytest.approx(want, abs=2e-6)
    assert t_cdf(want, df) == pytest.approx(p, abs=1e-7) and t_cdf(-want, df) == pytest.approx(1 - p, abs=1e-7)


def test_sign_flip_is_exact():
    assert sign_flip_p([1.0] * 8) == 1 / 256  # only the observed pattern is as large
    assert sign_flip_p([1.0] * 8, "less") == 1.0
    assert sign_flip_p([1.0] * 8, "two-sided") == 2 / 256
    d = [3.0, -1.0, 2.0, 0.5]
    patterns = [sum(s * v for s, v in zip(signs, d)) for signs in itertools.product((1, -1), repeat=4)]
    assert sign_flip_p(d) == sum(m >= sum(d) for m in patterns) / 16
    # a margin shifts the null: differences of +1 each are not above a margin of 2
    assert sign_flip_p([1.0] * 8, "greater", margin=2.0) == 1.0
    assert sign_flip_p([-1.0] * 8, "greater", margin=-5.0) == 1 / 256  # non-inferiority: -1 > -5 everywhere
    with pytest.raises(ValueError, match="alternative must be one of"):
        sign_flip_p(d, "bigger")


def test_holm_step_down():
    adj = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.2})
    assert adj == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.2})  # monotone: b takes c's 0.09


def test_paired_summary():
    d = [2.0, 4.0, 6.0, 8.0]
    s = paired_summary(d)
    sd = math.sqrt(sum((x - 5) ** 2 for x in d) / 3)
    assert (s.n, s.mean, s.sd) == (4, 5.0, pytest.approx(sd))
    assert s.ci_low == pytest.approx(5 - 3.182446 * sd / 2, abs=1e-5)
    assert s.bound == pytest.approx(5 - 2.353363 * sd / 2, abs=1e-5)
    assert s.p_sign_flip == 1 / 16
    less = paired_summary(d, "less")
    assert less.bound == pytest.approx(5 + 2.353363 * sd / 2, abs=1e-5) and less.p_sign_flip == 1.0
    assert math.isnan(paired_summary([1.0]).sd)
