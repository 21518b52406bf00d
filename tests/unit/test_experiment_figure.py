"""The experiment figure's curves (exact values) and the issue-27 figure's target line and smoothed panels."""
from __future__ import annotations

import json

import pytest

from sparse_rl_megatron.experiment.analysis import DESIGNS, arm_table, decide
from sparse_rl_megatron.experiment.config import ExperimentConfig
from sparse_rl_megatron.experiment.figure import (
    SMOOTH_STEPS, _curve, _trailing_mean, arm_labels, draw_figure, draw_tests_figure,
)
from sparse_rl_megatron.experiment.figure import main as figure_main
from sparse_rl_megatron.experiment.results import run_maxima, write_report
from sparse_rl_megatron.utils.config_io import load_config


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



ARMS_39 = {"dense": (0.0, None, 106.0), "naive_low": (6.0, [14.0], 29.0), "sparse_rl_low": (1.0, [14.0], 29.0),
           "naive_mid": (1.5, [16.0], 31.0), "sparse_rl_mid": (1.0, [16.0], 31.0),
           "sparse_rl_adaptive": (1.0, [16.0, 18.0, 21.0, 19.0], 33.3)}
"""arm -> (points below dense at the end, the budgets its steps sample with in turn, KV tokens per sequence)."""


def _study_39(seeds=tuple(range(8))) -> dict:
    """Hand-made issue-39 records: evaluations at steps 0, 25, ..., 150 (shortcut-free accuracy, both modes) and 12
    rollout steps (budget, KV tokens, the step's largest grad norm: arm-, seed- and step-dependent)."""
    out = {}
    for a, (arm, (gap, budgets, kv)) in enumerate(ARMS_39.items()):
        for s in seeds:
            recs = []
            for i in range(7):
                acc = 0.6 + (0.35 - gap / 100 - 0.004 * s * (a > 0)) * min(1.0, i / 3)
                recs.append({"step": 25 * i, "eval/dense/shortcut_free_accuracy": acc,
                             "eval/sparse/shortcut_free_accuracy": acc - 0.2 - 0.001 * a,
                             "eval/dense/accuracy": acc, "eval/sparse/accuracy": acc - 0.2})
            for step in range(1, 13):
                r = {"step": step, "rollout/kv_tokens_peak_mean": kv + 0.1 * (step % 2),
                     "train/grad_norm_max": 0.1 * (1 + a) + 0.01 * s + 0.05 * (step == 7 + s)}
                if budgets:
                    r["rollout/budget_sampled_mean"] = budgets[step % len(budgets)]
                recs.append(r)
            out.setdefault(arm, {})[s] = recs
    return out


def _capture_figures(monkeypatch) -> list:
    """The figures ``plt.close`` is given (the drawing functions close what they save)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (closed.append(fig), real_close(fig)))
    return closed


def test_arm_labels_name_each_arms_budget_from_its_records():
    labels = arm_labels(_study_39())
    assert labels["dense"] == "dense (dense KV)"
    assert labels["naive_low"] == "naive_low (B = 14)" and labels["sparse_rl_mid"] == "sparse_rl_mid (B = 16)"
    assert labels["sparse_rl_adaptive"] == "sparse_rl_adaptive (adaptive B = 16-21)"


def test_run_maxima_is_each_runs_largest_step_value():
    maxima = run_maxima(_study_39())
    # arm index a, seed s: 0.1 (1 + a) + 0.01 s, plus 0.05 at step 7 + s
    assert maxima["dense"] == pytest.approx({s: 0.1 + 0.01 * s + 0.05 * (s < 6) for s in range(8)})
    assert maxima["naive_low"][3] == pytest.approx(0.2 + 0.03 + 0.05)
    assert run_maxima({"x": {0: [{"step": 0, "train/grad_norm_max": 9.0}, {"step": 1}]}}) == {}


def test_lagchain_claims_figure_names_budgets_scales_kv_to_the_compressed_arms_and_draws_grad_norm_linear(
        tmp_path, monkeypatch):
    closed = _capture_figures(monkeypatch)
    design = DESIGNS.get("lagchain_claims")
    records = _study_39()
    draw_figure(records, tmp_path / "claims.png", "arms", design.panels, {}, design.smoothed, arm_labels(records),
                design.offscale)
    fig = closed[0]
    texts = [t.get_text() for leg in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
             for t in leg.get_texts()]
    assert texts == list(arm_labels(records).values())
    assert "naive_low (B = 14)" in texts and "sparse_rl_adaptive (adaptive B = 16-21)" in texts
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    grad = [ax for title, ax in axes.items() if "grad norm" in title]
    assert len(grad) == 1 and grad[0].get_yscale() == "linear"
    kv = axes["KV tokens held per sequence (peak)"]
    drawn = {line.get_label() for line in kv.get_lines()}
    assert "dense (dense KV)" not in drawn and "naive_low (B = 14)" in drawn
    low, high = kv.get_ylim()
    assert 29.0 > low and 33.4 < high < 60  # the compressed arms fill the axis; dense's 106 is not on it
    notes = [t.get_text() for t in kv.texts]
    assert notes == ["dense (dense KV): 106.0 on average (off this axis)"]


def test_tests_figure_shows_the_analysis_differences_mean_ci_margin_and_verdict(tmp_path, monkeypatch):
    closed = _capture_figures(monkeypatch)
    records = _study_39()
    tests = json.loads(json.dumps(decide(arm_table(records), design=DESIGNS.get("lagchain_claims"))))  # as analysis.json
    out = draw_tests_figure(tests, tmp_path / "tests.png", run_maxima(records), arm_labels(records))
    assert out.is_file()
    fig = closed[0]
    panels = {ax.get_title().split(":")[0]: ax for ax in fig.axes if ax.get_title()}
    assert set(tests) < set(panels)
    for name, r in tests.items():
        ax = panels[name]
        assert r["verdict"].split(" (")[0] in ax.get_title().replace("\n", " ")
        dots = [line for line in ax.get_lines() if line.get_label() == "d_s, per seed"][0]
        assert list(dots.get_xdata()) == r["seeds"] == list(range(8))
        assert list(dots.get_ydata()) == r["diffs"]
        margin = [line for line in ax.get_lines() if line.get_linestyle() == "--"][0]
        assert list(margin.get_ydata()) == [r["margin"]] * 2
        mean = [line for line in ax.get_lines() if line.get_marker() == "D"][0]
        assert list(mean.get_ydata()) == [r["mean"]]
        bars = ax.collections[0].get_segments()[0]  # the 95% t interval
        assert [bars[0][1], bars[1][1]] == pytest.approx([r["ci_low"], r["ci_high"]])
    assert tests["C1"]["verdict"] == "supported" and tests["C1"]["mean"] == pytest.approx(7.4)  # 6 + 0.4 s
    assert "footprint 33.3" in panels["A"].get_title().replace("\n", " ")
    grad = [ax for ax in fig.axes if ax.get_title().startswith("largest grad norm of a run")][0]
    assert grad.get_yscale() == "linear"
    dots = [line for line in grad.get_lines() if line.get_marker() == "o"]
    assert [sorted(line.get_ydata()) for line in dots] == [sorted(v.values()) for v in run_maxima(records).values()]


def test_the_tests_figure_is_drawn_from_a_saved_analysis(tmp_path, monkeypatch):
    closed = _capture_figures(monkeypatch)
    tests = decide(arm_table(_study_39()), design=DESIGNS.get("lagchain_claims"))
    (tmp_path / "analysis.json").write_text(json.dumps({"tests": tests}, default=str))
    out = figure_main([str(tmp_path / "analysis.json"), str(tmp_path / "t.png")])
    assert out.is_file() and len([ax for ax in closed[0].axes if ax.get_title()]) == len(tests)


def test_write_report_draws_the_tests_figure_from_its_analysis(tmp_path):
    cfg = load_config(ExperimentConfig, "configs/experiments/lagchain_claims.yaml",
                      [f"experiment.out={str(tmp_path)!r}", "experiment.seeds=[0,1,2,3,4,5,6,7]"])
    for arm, by_seed in _study_39().items():
        for seed, recs in by_seed.items():
            run = tmp_path / f"seed_{seed}" / arm
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
            (run / "arm_done.json").write_text("{}")
    write_report(cfg)
    for name in ("figure.png", "figure_claims.png", "figure_tests.png", "analysis.json"):
        assert (tmp_path / name).is_file()


def test_the_docs_tests_figure_data_is_the_docs_table():
    """docs/figures/lagchain_tests.json (what docs/figures/lagchain_tests.png is drawn from) holds issue 39's table
    "The pre-registered tests" as docs/experiments.md prints it, and its means and intervals are those of its d_s."""
    from pathlib import Path

    from sparse_rl_megatron.experiment.stats import paired_summary

    root = Path(__file__).resolve().parents[2]
    saved = json.loads((root / "docs/figures/lagchain_tests.json").read_text())["tests"]
    doc = (root / "docs/experiments.md").read_text()
    section = doc[doc.index("## Issue 39: results"):doc.index("## Issue 27: pre-registration")]
    table = section[section.index("### The pre-registered tests"):].split("\n\n")[1].splitlines()[2:]
    rows = {line.split("|")[1].split()[0].rstrip(":"): [c.strip() for c in line.split("|")[2:-1]] for line in table}
    assert sorted(rows) == sorted(saved) == sorted(t.name for t in DESIGNS.get("lagchain_claims").tests)
    for name, r in saved.items():
        d_s, mean, ci, bound, margin = rows[name][:5]
        assert [float(x) for x in d_s.split(", ")] == r["diffs"] and len(r["diffs"]) == len(r["seeds"]) == 8
        assert (float(mean), float(bound), float(margin)) == (r["mean"], r["bound"], r["margin"])
        assert [float(x) for x in ci.strip("[]").split(", ")] == [r["ci_low"], r["ci_high"]]
        again = paired_summary(r["diffs"], "greater", r["margin"])  # from the rounded d_s: within the rounding
        assert abs(again.mean - r["mean"]) <= 0.06 and abs(again.ci_low - r["ci_low"]) <= 0.1
        assert abs(again.ci_high - r["ci_high"]) <= 0.1
        assert r["test"]["claim"] == next(t.claim for t in DESIGNS.get("lagchain_claims").tests if t.name == name)


def test_the_tests_figure_command_refuses_a_missing_or_foreign_file_in_one_line(tmp_path, capsys):
    foreign = tmp_path / "results.json"
    foreign.write_text('{"arms": {}}')
    for path, why in ((tmp_path / "missing.json", "cannot read"), (foreign, "has no 'tests' object")):
        with pytest.raises(SystemExit) as exit_info:
            figure_main([str(path), str(tmp_path / "out.png")])
        assert exit_info.value.code == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "out.png").exists()
