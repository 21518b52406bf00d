"""The adaptive-budget study's design (configs/experiments/adaptive_claims.yaml) without running anything: the
contamination budget rule picks the level budgets, the arms run at their levels (the adaptive one starting at the mid
level), and the registered analysis decides on the shortcut-free endpoints with Holm, the fixed tracking sequence and
the adaptive arm's footprint rule."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparse_rl_megatron.experiment.analysis import DESIGNS, arm_table, decide
from sparse_rl_megatron.experiment.analysis_report import write_analysis
from sparse_rl_megatron.experiment.arms import arm_runs
from sparse_rl_megatron.experiment.arm_dirs import arm_train_config
from sparse_rl_megatron.experiment.budget_rule import RULE_FILE, apply_budget_rule, choose_levels
from sparse_rl_megatron.experiment.config import BudgetRuleConfig, ExperimentConfig
from sparse_rl_megatron.utils.config_io import ConfigError, load_config
from sparse_rl_megatron.utils.errors import UserError

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "experiments" / "adaptive_claims.yaml"
CANDIDATES = [3, 4, 6, 8, 12, 16]


def _per_seed(shares: dict[int, list[float]]) -> dict[int, dict]:
    """``row_stats`` of seeds whose contamination share at ``CANDIDATES`` is ``shares[seed]``."""
    return {s: {"dense": {"veto": 0.0, "reward": 0.5, "contaminated": 0.0},
                **{f"rkv B={b}": {"veto": 0.0, "reward": 0.4, "contaminated": c} for b, c in zip(CANDIDATES, v)}}
            for s, v in shares.items()}


def test_each_level_gets_the_candidate_nearest_its_contamination_target_distinct_and_ordered():
    rule = BudgetRuleConfig(kind="contamination", candidates=CANDIDATES, levels={"low": 0.5, "mid": 0.25, "high": 0.1})
    # pooled (mean of the two seeds): 0.70, 0.52, 0.31, 0.20, 0.10, 0.04
    shares = {0: [0.8, 0.54, 0.32, 0.2, 0.12, 0.04], 1: [0.6, 0.5, 0.3, 0.2, 0.08, 0.04]}
    choice = choose_levels(_per_seed(shares), "rkv", rule)
    assert choice["levels"] == {"low": 4, "mid": 8, "high": 12}  # 0.25: |0.31 - 0.25| = 0.06 > |0.20 - 0.25|
    assert (choice["budget"], choice["harsh_budget"], choice["collapsed"]) == (8, 4, [])
    assert [round(r["contaminated"], 6) for r in choice["table"]] == [0.7, 0.52, 0.31, 0.2, 0.1, 0.04]
    # not monotone (the pilot seed's shape): a budget's level share is the worst at it or above (0.25 at B = 4)
    bumpy = choose_levels(_per_seed({0: [0.93, 0.14, 0.25, 0.01, 0.0, 0.0]}), "rkv", rule)
    assert [r["contaminated_at_or_above"] for r in bumpy["table"]] == [0.93, 0.25, 0.25, 0.01, 0.0, 0.0]
    assert bumpy["levels"] == {"low": 4, "mid": 6, "high": 8}  # mid: a tie of 4 and 6 -> 6; low: below 6
    # a tie (0.35 and 0.15 are both 0.1 from 0.25): the larger budget; the lower levels below it
    tied = choose_levels(_per_seed({0: [0.9, 0.9, 0.35, 0.15, 0.12, 0.11]}), "rkv", rule)
    assert tied["levels"] == {"low": 6, "mid": 8, "high": 16}
    # fewer candidates than levels: the last level shares the budget above it and is listed as collapsed
    two = BudgetRuleConfig(kind="contamination", candidates=[3, 4], levels={"low": 0.5, "mid": 0.25, "high": 0.1})
    short = choose_levels({0: {"dense": {"veto": 0, "reward": 0.5, "contaminated": 0},
                               "rkv B=3": {"veto": 0, "reward": 0.1, "contaminated": 0.9},
                               "rkv B=4": {"veto": 0, "reward": 0.4, "contaminated": 0.1}}}, "rkv", two)
    assert short["levels"] == {"low": 3, "mid": 3, "high": 4} and short["collapsed"] == ["low"]


@pytest.mark.parametrize("rule", [{"kind": "contamination"}, {"kind": "contamination", "levels": {"low": 1.5}},
                                  {"kind": "contamination", "levels": {"low": 0.5}}, {"kind": "fixed"}])
def test_bad_contamination_rules_are_refused(rule):
    with pytest.raises(ValueError, match="BudgetRuleConfig"):
        BudgetRuleConfig(**rule)


def test_the_arms_run_at_their_level_and_the_adaptive_arm_starts_at_the_mid_level(tmp_path):
    cfg = load_config(ExperimentConfig, RECIPE, [f"experiment.out={tmp_path}"])
    with pytest.raises(UserError, match="--stage budgets"):
        apply_budget_rule(cfg)
    (tmp_path / RULE_FILE).write_text(json.dumps({"budget": 6, "harsh_budget": 4,
                                                  "levels": {"low": 4, "mid": 6, "high": 12}}))
    cfg = apply_budget_rule(cfg)
    assert cfg.experiment.level_budgets == {"low": 4, "mid": 6, "high": 12} and cfg.experiment.harsh_budget == 4
    runs = {r.name: arm_train_config(cfg, r, 2, tmp_path / "warm") for r in arm_runs(cfg.experiment.arms, [])}
    got = {n: (c.rollout.compression.method, c.rollout.compression.budget, c.correction.mode,
               c.rollout.adaptive_budget.enabled) for n, c in runs.items()}
    assert got == {"dense": ("none", 6, "none", False), "naive_low": ("rkv", 4, "none", False),
                   "sparse_rl_low": ("rkv", 4, "sparse_rl", False), "sparse_rl_mid": ("rkv", 6, "sparse_rl", False),
                   "sparse_rl_high": ("rkv", 12, "sparse_rl", False),
                   "sparse_rl_adaptive": ("rkv", 6, "sparse_rl", True)}
    assert {c.eval.compression.describe() for c in runs.values()} == {"rkv B=6 alpha=2 W=4 scope=response"}
    adaptive = runs["sparse_rl_adaptive"].rollout.adaptive_budget
    assert (adaptive.target, adaptive.min_budget, adaptive.max_budget, adaptive.granule) == (0.2, 3, 32, 1)


def test_level_arms_need_their_budgets():
    with pytest.raises(ConfigError, match=r"experiment\.level_budgets"):
        load_config(ExperimentConfig, RECIPE, ["experiment.budgets_from_rule=false"])
    with pytest.raises(ConfigError, match=r"experiment\.analysis"):
        load_config(ExperimentConfig, RECIPE, ["experiment.analysis=no_such_design"])
    from sparse_rl_megatron.experiment.runner import _check_arms

    cfg = load_config(ExperimentConfig, RECIPE, ["experiment.level_budgets={low: 4, mid: 6}"])
    with pytest.raises(UserError, match="sparse_rl_high"):
        _check_arms(cfg)


def _run(free: list[float], kv: float, budget: float | None = None) -> list[dict]:
    """Records with shortcut-free evaluations ``free`` (fractions) at steps 0, 25, ... and 4 rollout steps
    holding ``kv`` KV tokens per sequence."""
    recs = [{"step": 25 * i, "eval/dense/accuracy": 0.5, "eval/sparse/accuracy": 0.5,
             "eval/dense/shortcut_free_accuracy": a, "eval/sparse/shortcut_free_accuracy": a - 0.01}
            for i, a in enumerate(free)]
    return recs + [{"step": s, "rollout/kv_tokens_peak_mean": kv + (s - 2.5) / 10,
                    **({"rollout/budget_sampled_mean": budget} if budget else {})} for s in range(1, 5)]


def _study(gaps: dict[str, float], kv_adaptive: float, seeds: int = 8) -> dict:
    """Every issue-27 arm on ``seeds`` seeds: dense rises 0.5 -> 0.9 (shortcut-free), each other arm ends
    ``gaps[arm]`` below dense's endpoint (plus a per-seed jitter of 0-1.4 points)."""
    kv = {"dense": 76.0, "naive_low": 15.0, "sparse_rl_low": 15.0, "sparse_rl_mid": 19.0, "sparse_rl_high": 25.0}
    out = {}
    for arm in ("dense", *gaps):
        out[arm] = {}
        for s in range(seeds):
            end = 0.9 - gaps.get(arm, 0.0) + 0.002 * s * (arm != "dense")
            curve = [0.5, 0.7, 0.8, 0.85, end, end, end]
            out[arm][s] = _run(curve, kv_adaptive if arm == "sparse_rl_adaptive" else kv[arm])
    return out


def test_the_adaptive_claims_analysis_decides_by_its_registered_rules(tmp_path):
    design = DESIGNS.get("adaptive_claims")
    gaps = {"naive_low": 0.30, "sparse_rl_low": 0.12, "sparse_rl_mid": 0.02, "sparse_rl_high": 0.01,
            "sparse_rl_adaptive": 0.02}
    table = arm_table(_study(gaps, kv_adaptive=18.0))
    assert table["sparse_rl_mid"][0]["kv_tokens"] == pytest.approx(19.0)
    res = decide(table, design=design)
    assert res["check"]["verdict"] == "supported" and res["check"]["mean"] == pytest.approx(40.0)
    assert sorted(n for n, r in res.items() if "p_holm" in r) == ["A", "C1", "C2b", "C3", "G"]
    assert res["C1"]["mean"] == pytest.approx(30.0 - 0.7) and res["C1"]["verdict"] == "supported"
    assert res["C2b"]["verdict"] == "supported" and res["G"]["verdict"] == "supported"
    # C3 on the sparse endpoints: mid is 2 - 0.2 s points below dense (jitter 0.2 s, mean 0.7) -> against
    assert res["C3"]["verdict"] == "against"
    # the sequence: high (-1 + ...) and mid (-2 + ...) track, low (-12 + ...) does not
    assert [res[t]["verdict"] for t in ("T_high", "T_mid", "T_low")] == ["supported", "supported", "against"]
    assert "p_holm" not in res["T_mid"]
    fp = res["A"]["footprint"]
    assert (fp["reference_arm"], fp["reference_kv_tokens"], fp["arm_kv_tokens"]) == ("sparse_rl_mid", 19.0, 18.0)
    assert res["A"]["verdict"] == "supported" and res["A"]["tracking_verdict"] == "supported"
    # a larger footprint than the smallest tracking budget: tracks, but not supported
    big = decide(arm_table(_study(gaps, kv_adaptive=20.0)), design=design)
    assert big["A"]["tracking_verdict"] == "supported" and big["A"]["verdict"].startswith("not supported")
    # the sequence stops at the first failure: high fails -> mid and low "not reached"; reference = the largest
    worse = decide(arm_table(_study({**gaps, "sparse_rl_high": 0.10}, kv_adaptive=24.0)), design=design)
    assert worse["T_high"]["verdict"] == "against" and worse["T_mid"]["verdict"].startswith("not reached")
    assert worse["A"]["footprint"]["reference_arm"] == "sparse_rl_high" and worse["A"]["verdict"] == "supported"
    md = write_analysis(tmp_path, _study(gaps, kv_adaptive=18.0), design_name="issue27").read_text()
    assert "Holm over C1, C2b, C3, G, A" in md and "A, footprint: 18.0 KV tokens per sequence against 19.0" in md
    assert "## Per seed, shortcut-free dense endpoint" in md and "| sparse_rl_adaptive | 8 |" in md
    # the checkpoint study is descriptive in this design: issue 20's study tests (naive vs sparse_rl) do not apply
    study = {"compounding": {}, "caches": {}, "study_tests": {}}
    md = write_analysis(tmp_path, _study(gaps, kv_adaptive=18.0), study, design_name="issue27").read_text()
    assert md.endswith("## Study tests (secondary, unadjusted)\n(none registered for this design: its checkpoint "
                       "study is descriptive)\n")
    md = write_analysis(tmp_path, _study(gaps, kv_adaptive=18.0), study, design_name="issue20").read_text()
    assert md.endswith("## Study tests (secondary, unadjusted)\n(not run)\n")


def test_the_results_table_shows_the_kv_tokens_budget_and_contamination_of_each_arm():
    from sparse_rl_megatron.experiment.results import markdown_table, seed_summary

    recs = _run([0.5] * 7, kv=15.0, budget=4.0)
    for r in recs[7:]:
        r["sparse/contaminated_frac"] = 0.25
    row = seed_summary(recs, {"cpu_seconds": 270.0})
    assert (row["kv_tokens_held"], row["budget"], row["contaminated_frac"]) == (pytest.approx(15.0), 4.0, 0.25)
    md = markdown_table({"arms": {"sparse_rl_low": {"seeds": {0: row}, "mean": row, "std": dict.fromkeys(row)}}})
    assert "KV tokens / sequence | mean budget | contaminated seqs" in md and "| 15.0 | 4.0 | 0.250 |" in md
