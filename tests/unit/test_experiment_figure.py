"""The experiment figure's curves (exact values) and the issue-27 figure's target line and smoothed panels."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.experiment.figure import SMOOTH_STEPS, _curve, _trailing_mean, draw_figure


def test_trailing_mean_averages_the_step_and_the_earlier_logged_ones():
    series = {1: 1.0, 2: 3.0, 4: 5.0, 5: 9.0}  # step 3 not logged: the window counts logged steps
    assert _trailing_mean(series, 1) == series
    assert _trailing_mean(series, 2) == {1: 1.0, 2: 2.0, 4: 4.0, 5: 7.0}
    assert _trailing_mean(series, 3) == {1: 1.0, 2: 2.0, 4: 3.0, 5: 17.0 / 3}


def test_curve_smooths_each_seed_then_takes_mean_min_max_over_the_seeds():
    by_seed = {0: [{"step": s, "x": v} for s, v in [(1, 0.0), (2, 1.0), (3, 0.0)]],
               1: [{"step": s, "x": v} for s, v in [(1, 1.0), (2, 1.0), (3, 1.0)]] + [{"step": 4, "x": None}]}
    assert _curve(by_seed, "x") == ([1, 2, 3], [0.5, 1.0, 0.5], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    steps, mean, low, high = _curve(by_seed, "x", window=2)
    assert steps == [1, 2, 3] and mean == [0.5, 0.75, 0.75] and low == [0.0, 0.5, 0.5] and high == [1.0] * 3


def test_the_target_is_a_dashed_line_in_its_panel_and_smoothed_panels_say_so(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (closed.append(fig), real_close(fig)))
    records = {"arm": {0: [{"step": s, "sparse/contaminated_frac": 0.1 * (s % 3), "rollout/reward_mean": 0.5}
                           for s in range(1, 30)]}}
    panels = {"contaminated": "sparse/contaminated_frac", "reward": "rollout/reward_mean"}
    out = draw_figure(records, tmp_path / "f.png", "arms", panels, marks={"contaminated": (0.2, "target 0.2")},
                      smooth=frozenset({"contaminated"}))
    assert out.is_file() and out.stat().st_size > 0
    axes = {ax.get_title(): ax for ax in closed[0].axes if ax.get_title()}
    assert set(axes) == {f"contaminated ({SMOOTH_STEPS}-step mean)", "reward"}
    smoothed = axes[f"contaminated ({SMOOTH_STEPS}-step mean)"]
    dashed = [line for line in smoothed.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and list(dashed[0].get_ydata()) == [0.2, 0.2]
    curve = [line for line in smoothed.get_lines() if line.get_linestyle() == "-"][0]
    # smoothed: from step 10 on the window holds each of 0, 0.1, 0.2 three or four times, near their mean 0.1
    assert max(abs(y - 0.1) for y in curve.get_ydata()[9:]) <= 0.1 / SMOOTH_STEPS + 1e-12
    assert not [line for line in axes["reward"].get_lines() if line.get_linestyle() == "--"]
    assert pytest.approx(list(axes["reward"].get_lines()[0].get_ydata())) == [0.5] * 29
