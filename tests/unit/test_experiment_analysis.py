"""The pre-registered analysis on hand-made metrics records: endpoints, collapse criteria, paired tests with
Holm, the manipulation check, and the markdown it writes."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.experiment.analysis import arm_table, collapse, decide, endpoint
from sparse_rl_megatron.experiment.analysis_report import write_analysis

KEY = "eval/dense/accuracy"


def _run(accs, sparse=None, cls=None, **per_step):
    """Records with evaluations at steps 0, 25, ... (``accs`` as fractions) and rollout metrics per step."""
    recs = []
    for i, a in enumerate(accs):
        r = {"step": 25 * i, KEY: a, "eval/sparse/accuracy": (sparse or accs)[i],
             "eval/dense/no_answer_frac": 0.0, "eval/dense/truncated_frac": 0.0}
        if cls is not None:
            r["eval/dense/modchain_weak/subset_odd_x_stop/accuracy"] = cls[i]
        recs.append(r)
    for step, values in per_step.get("steps", {}).items():
        recs.append({"step": step, **values})
    return recs


def test_endpoint_is_the_mean_of_the_last_three_evaluations():
    recs = _run([0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    assert endpoint(recs, KEY) == pytest.approx(90.0) and endpoint(recs, KEY, 1) == pytest.approx(100.0)
    assert endpoint(_run([0.4, 0.5]), KEY) is None


def test_collapse_criteria():
    assert collapse(_run([0.4, 0.5, 0.6, 0.62, 0.6, 0.61, 0.6])) is None
    # (a): after step 50 falls 15 below the running max (0.7 at step 75) and stays 10 below
    assert collapse(_run([0.4, 0.5, 0.6, 0.7, 0.55, 0.59, 0.5])) == "a"
    assert collapse(_run([0.4, 0.5, 0.6, 0.7, 0.55, 0.65, 0.62])) is None  # back within 10 points at step 125
    assert collapse(_run([0.4, 0.8, 0.6, 0.75, 0.75, 0.75, 0.75])) is None  # the drop at step 50 is not after it
    assert collapse(_run([0.4, 0.8, 0.6, 0.6, 0.6, 0.6, 0.6])) == "a"  # the running max counts from step 0
    bad = _run([0.4, 0.5, 0.6])
    bad[1]["eval/dense/no_answer_frac"], bad[1]["eval/dense/truncated_frac"] = 0.2, 0.05
    assert collapse(bad) == "b"
    # the warm start's own bad outputs (step 0) are not a collapse of the run, nor is a share that falls from them
    early_stop = _run([0.4, 0.5, 0.6])
    early_stop[0]["eval/dense/no_answer_frac"], early_stop[1]["eval/dense/no_answer_frac"] = 0.345, 0.3
    assert collapse(early_stop) is None
    early_stop[2]["eval/dense/no_answer_frac"] = 0.36  # worse than the warm start, and >= 25%
    assert collapse(early_stop) == "b"
    rep = _run([0.4, 0.5], steps={s: {"rollout/repetition_rate": 0.03 if 5 <= s < 15 else 0.0} for s in range(1, 30)})
    assert collapse(rep) == "c"
    rep9 = _run([0.4, 0.5], steps={s: {"rollout/repetition_rate": 0.03 if 5 <= s < 14 else 0.0} for s in range(1, 30)})
    assert collapse(rep9) is None


def _records(shift_naive, shift_srl, seeds=8):
    base = [0.4, 0.45, 0.5, 0.55, 0.6, 0.6, 0.6]
    out = {"dense": {}, "naive": {}, "sparse_rl": {}}
    for s in range(seeds):
        jitter = 0.01 * (s % 3)
        out["dense"][s] = _run([b + jitter for b in base])
        out["naive"][s] = _run([base[0] + jitter] + [b + jitter - shift_naive for b in base[1:]])
        out["sparse_rl"][s] = _run([base[0] + jitter] + [b + jitter - shift_srl + 0.002 * s for b in base[1:]])
    return out


def test_decisions_follow_the_preregistered_rule(tmp_path):
    table = arm_table(_records(shift_naive=0.1, shift_srl=0.02))
    res = decide(table)
    assert res["check"]["verdict"] == "supported" and res["check"]["mean"] == pytest.approx(20.0)
    assert res["C1"]["verdict"] == "supported" and res["C1"]["mean"] == pytest.approx(10.0)
    assert res["C1"]["p_sign_flip"] == 1 / 256 and res["C1"]["p_holm"] <= 4 / 256
    assert res["C2a"]["verdict"] == "supported"  # -2 + 0.2 s points, all above -5
    assert res["C2b"]["verdict"] == "supported"
    assert res["C3"]["verdict"] == "against"  # the synthetic sparse accuracies equal the dense ones: 2 points lower
    assert res["dose1"]["verdict"].startswith("not run")  # no naive_harsh arm
    # Sparse-RL 8 points below dense: C2a fails (bound below -5), and it is not "against" C2a's margin... it is
    worse = decide(arm_table(_records(shift_naive=0.1, shift_srl=0.08)))
    assert worse["C2a"]["verdict"] == "against" and worse["C2b"]["verdict"] == "supported"
    # dense RL that does not learn makes C1 and C2 untestable
    flat = _records(0.0, 0.0)
    for s in flat["dense"]:
        flat["dense"][s] = _run([0.4] * 7)
    assert decide(arm_table(flat))["C1"]["verdict"].startswith("not testable")
    md = write_analysis(tmp_path, _records(0.1, 0.02)).read_text()
    assert "| C1 | naive sparse rollouts degrade GRPO | 8 |" in md and "supported" in md


def test_class_endpoints_are_tabulated():
    recs = {"dense": {0: _run([0.4] * 7, cls=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])}}
    row = arm_table(recs)["dense"][0]
    assert row["dense_odd_x_stop_start"] == pytest.approx(10.0) and row["dense_odd_x_stop_end"] == pytest.approx(60.0)


def test_shortcut_free_endpoints_are_tabulated_next_to_the_classes():
    from sparse_rl_megatron.experiment.analysis_report import arms_markdown

    run = _run([0.4] * 7)
    for i, r in enumerate(run):
        r["eval/dense/shortcut_free_accuracy"], r["eval/sparse/shortcut_free_accuracy"] = 0.1 * i, 0.05 * i
    row = arm_table({"dense": {0: run}})["dense"][0]
    assert row["dense_start"] == pytest.approx(40.0) and row["dense_end"] == pytest.approx(40.0)  # not overwritten
    assert row["dense_shortcut_free_start"] == pytest.approx(0.0) and row["dense_shortcut_free_end"] == pytest.approx(50.0)
    assert row["sparse_shortcut_free_final"] == pytest.approx(30.0)
    md = arms_markdown({"dense": {0: row}})
    assert "shortcut_free dense start → endpoint" in md and "| 0.0 → 50.0 |" in md
    assert not any("shortcut_free" in k for k in arm_table({"dense": {0: _run([0.4] * 7)}})["dense"][0])


def test_the_control_has_one_evaluation_as_endpoint_and_the_shared_start():
    recs = {"dense": {0: _run([0.4, 0.5, 0.6, 0.6])}, "sft": {0: [{"step": 150, KEY: 0.45,
                                                                  "eval/sparse/accuracy": 0.3}]}}
    row = arm_table(recs)["sft"][0]
    assert row["dense_end"] == pytest.approx(45.0) and row["dense_start"] == pytest.approx(40.0)
    assert row["sparse_end"] == pytest.approx(30.0) and row["collapse"] is None
