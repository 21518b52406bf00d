"""The idle-share arithmetic of ``bench/bench_tail.py`` (issue 54's tail measurement), exact values."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_tail import idle_row_step_share, idle_row_time_share, quantile  # noqa: E402


def test_idle_row_step_share_exact():
    # rows 4: idle steps (10-10) + (10-5) + (10-2) + (10-1) = 22 of 4 * 10 = 40
    assert idle_row_step_share([10, 5, 2, 1]) == pytest.approx(22 / 40, abs=0)
    assert idle_row_step_share([7, 7, 7]) == 0.0
    assert idle_row_step_share([0, 0]) == 0.0
    # one long row among many short ones: the tail's cost grows with the rows it holds back
    assert idle_row_step_share([100] + [1] * 9) == pytest.approx(9 * 99 / 1000, abs=0)


def test_idle_row_step_share_refuses_empty_and_negative():
    with pytest.raises(ValueError):
        idle_row_step_share([])
    with pytest.raises(ValueError):
        idle_row_step_share([3, -1])


def test_idle_row_time_share_and_quantile():
    assert idle_row_time_share([1.0, 2.0, 4.0]) == pytest.approx(1 - 7 / 12)
    assert idle_row_time_share([0.0, 0.0]) == 0.0
    assert quantile([1, 2, 3, 4], 0.5) == 2.5
    assert quantile([5, 1, 3], 0.9) == pytest.approx(4.6)
    assert quantile([2], 0.9) == 2
