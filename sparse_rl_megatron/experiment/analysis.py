"""The pre-registered analyses (docs/experiments.md): endpoints, collapse, the primary tests with Holm, the
manipulation check, and the secondary comparisons (``analysis_report.write_analysis`` writes them as
``analysis.json`` / ``analysis.md``). ``DESIGNS`` holds each registration's tests by name
(``experiment.analysis``), named after the study's config: ``cpu_claims`` (also ``weak_claims``'), ``adaptive_claims``
(endpoint on the shortcut-free records, the tracking tests of the fixed budgets as a fixed sequence, and the adaptive
arm's footprint rule, ``footprint_rule``) and ``lagchain_claims`` (the tracking tests in the Holm family, naive at two
budgets). Saved configs and ``analysis.json`` files name them by their issues, ``RENAMED_DESIGNS``.

Endpoint of a run in a mode: the mean of its last ``ENDPOINT_EVALS`` evaluations of greedy held-out accuracy
(points). A paired difference takes, per seed, one arm's endpoint minus another's (the arms of a seed share
the warm start). Only seeds with every arm a test needs complete enter that test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from sparse_rl_megatron.experiment.figure import (
    CLAIM_PANELS, CLAIM_PANELS_ADAPTIVE, CLAIM_PANELS_LAGCHAIN, SMOOTHED_ADAPTIVE, SMOOTHED_LAGCHAIN,
)
from sparse_rl_megatron.experiment.stats import holm, paired_summary
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.utils.registry import Registry

ENDPOINT_EVALS = 3
ANALYSIS_JSON = "analysis.json"
ANALYSIS_MD = "analysis.md"
ALPHA = 0.05
COLLAPSE_AFTER_STEP = 50
COLLAPSE_DROP, COLLAPSE_STAY = 15.0, 10.0
"""Collapse (a): after step 50 dense accuracy falls >= 15 points below its running max and stays >= 10 below."""
COLLAPSE_BAD_OUTPUT = 0.25
"""Collapse (b): dense no-answer + truncated >= 25% at an evaluation after step 0, and above the warm start's own
share (step 0: a warm start that stops early on an untaught class is not a collapse of the RL run)."""
COLLAPSE_REPETITION, COLLAPSE_REPETITION_STEPS = 0.02, 10
"""Collapse (c): rollout repeated-4-gram rate >= 0.02 for 10 consecutive steps."""
FREE_KEYS = (MN.EVAL_DENSE_SHORTCUT_FREE_ACCURACY, MN.EVAL_SPARSE_SHORTCUT_FREE_ACCURACY)
"""Accuracy on the records no trivial policy answers (tasks that flag them; ``eval/subsets.py``): rows
``<mode>_shortcut_free_{start,end,final}``, shown next to the classes."""
SUBSET_KEY = MN.SUBSET_ACCURACY_KEY
KV_TOKENS_KEY = MN.ROLLOUT_KV_TOKENS_PEAK_MEAN
"""KV tokens a sequence held at its peak (prompt + kept response tokens), mean over a step's samples; a run's
footprint (``kv_tokens``) is its mean over the rollout steps."""
BUDGET_KEY = MN.ROLLOUT_BUDGET_SAMPLED_MEAN
"""The mean budget in a step's samples' provenance (compressed runs)."""


@dataclass(frozen=True)
class Test:
    """One paired comparison: per seed E_mode_a(arm_a) - E_mode_b(arm_b) (or minus the start when arm_b is
    ``start``), H1 mean > margin."""

    name: str
    claim: str
    arm_a: str
    arm_b: str
    mode: str = "dense"
    margin: float = 0.0
    primary: bool = True
    """In the Holm family; False: decided alone at alpha, unadjusted (or in the fixed sequence)."""
    metric: str = ""
    """The endpoint: ``""`` all held-out records, ``"_shortcut_free"`` the records no trivial policy answers."""
    sequence: bool = False
    """A fixed-sequence test: the design's sequence tests are decided in order, each at alpha unadjusted, and
    the first one not supported stops the sequence (the later ones: "not reached")."""


TESTS = (
    Test("C1", "naive sparse rollouts degrade GRPO", "dense", "naive"),
    Test("C2a", "Sparse-RL tracks dense rollouts (within 5 points)", "sparse_rl", "dense", margin=-5.0),
    Test("C2b", "the correction helps (Sparse-RL beats naive)", "sparse_rl", "naive"),
    Test("C3", "Sparse-RL is more robust under sparse inference", "sparse_rl", "dense", mode="sparse"),
    Test("check", "dense RL learns (manipulation check)", "dense", "start", primary=False),
    Test("dose1", "dose: dense beats naive at B_h", "dense", "naive_harsh", primary=False),
    Test("dose2", "dose: naive at B* beats naive at B_h", "naive", "naive_harsh", primary=False),
)


TESTS_ADAPTIVE = (
    Test("C1", "naive at the low budget degrades GRPO", "dense", "naive_low", metric="_shortcut_free"),
    Test("C2b", "the correction helps at the low budget (Sparse-RL beats naive)", "sparse_rl_low", "naive_low",
         metric="_shortcut_free"),
    Test("C3", "Sparse-RL (mid budget) is more robust under sparse inference (mid-budget cache)", "sparse_rl_mid",
         "dense", mode="sparse", metric="_shortcut_free"),
    Test("G", "the gap to dense grows as the budget falls (high beats low)", "sparse_rl_high", "sparse_rl_low",
         metric="_shortcut_free"),
    Test("A", "the adaptive budget tracks dense (within 5 points)", "sparse_rl_adaptive", "dense", margin=-5.0,
         metric="_shortcut_free"),
    Test("T_high", "Sparse-RL at the high budget tracks dense (within 5 points)", "sparse_rl_high", "dense",
         margin=-5.0, primary=False, metric="_shortcut_free", sequence=True),
    Test("T_mid", "Sparse-RL at the mid budget tracks dense (within 5 points)", "sparse_rl_mid", "dense",
         margin=-5.0, primary=False, metric="_shortcut_free", sequence=True),
    Test("T_low", "Sparse-RL at the low budget tracks dense (within 5 points)", "sparse_rl_low", "dense",
         margin=-5.0, primary=False, metric="_shortcut_free", sequence=True),
    Test("check", "dense RL learns (manipulation check)", "dense", "start", primary=False, metric="_shortcut_free"),
)


TESTS_LAGCHAIN = (
    Test("C1", "naive at the low budget degrades GRPO", "dense", "naive_low", metric="_shortcut_free"),
    Test("C1m", "naive at the mid budget degrades GRPO", "dense", "naive_mid", metric="_shortcut_free"),
    Test("C2", "the correction helps at the low budget (Sparse-RL beats naive)", "sparse_rl_low", "naive_low",
         metric="_shortcut_free"),
    Test("T_low", "Sparse-RL at the low budget tracks dense (within 5 points)", "sparse_rl_low", "dense",
         margin=-5.0, metric="_shortcut_free"),
    Test("T_mid", "Sparse-RL at the mid budget tracks dense (within 5 points)", "sparse_rl_mid", "dense",
         margin=-5.0, metric="_shortcut_free"),
    Test("C3", "Sparse-RL (mid budget) is more robust under sparse inference (mid-budget cache)", "sparse_rl_mid",
         "dense", mode="sparse", metric="_shortcut_free"),
    Test("A", "the adaptive budget tracks dense (within 5 points)", "sparse_rl_adaptive", "dense", margin=-5.0,
         metric="_shortcut_free"),
    Test("check", "dense RL learns (manipulation check)", "dense", "start", primary=False, metric="_shortcut_free"),
)
"""Issue 39's registered tests (docs/experiments.md, "Issue 39: pre-registration"): the paper's comparison, naive
rollouts degrade GRPO at a budget where Sparse-RL tracks dense, is C1 with T_low or C1m with T_mid."""


@dataclass(frozen=True)
class Footprint:
    """The adaptive arm's claim (issue 27): its tracking test ``test`` supported AND its mean KV tokens per
    sequence no larger than those of the smallest-budget arm of ``ladder`` (smallest first) whose tracking test
    (``ladder_tests``) is supported; when none is, the largest budget's arm is the reference."""

    test: str
    arm: str
    ladder: tuple[str, ...]
    ladder_tests: tuple[str, ...]


@dataclass(frozen=True)
class Design:
    """One registration's tests: the Holm family (``primary``), the fixed sequence, the ones the manipulation
    check gates (``gated``), and the adaptive arm's footprint rule."""

    tests: tuple[Test, ...]
    gated: tuple[str, ...]
    footprint: Footprint | None = None
    holm_note: str = ""
    study_tests: bool = False
    """Whether the registration decides tests on the checkpoint study (issue 20's naive vs sparse_rl); otherwise
    the study is descriptive."""
    panels: Mapping[str, str] = field(default_factory=lambda: CLAIM_PANELS)
    """The claims figure's panels (title -> metric; ``figure.py``)."""
    smoothed: frozenset[str] = frozenset()
    """Panels drawn as trailing means (per-step metrics of 64 sequences)."""
    mark_adaptive_target: bool = False
    """Mark the adaptive budget controller's target in the panel of the metric it holds."""
    offscale: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Panels (title -> arms) whose axis leaves these arms out, scaled to the others (a note gives their mean): the
    compressed arms' KV footprints differ by a few tokens below dense's ~3x larger one."""


DESIGNS: Registry[Design] = Registry("experiment analysis design")
DESIGNS.add("cpu_claims", Design(TESTS, ("C1", "C2a", "C2b"), holm_note="Holm over C1, C2a, C2b, C3",
                                  study_tests=True))
DESIGNS.add("adaptive_claims", Design(TESTS_ADAPTIVE, ("C1", "C2b", "G", "A", "T_high", "T_mid", "T_low"),
                              Footprint("A", "sparse_rl_adaptive", ("sparse_rl_low", "sparse_rl_mid", "sparse_rl_high"),
                                        ("T_low", "T_mid", "T_high")),
                              holm_note="Holm over C1, C2b, C3, G, A; T_high -> T_mid -> T_low a fixed sequence",
                              panels=CLAIM_PANELS_ADAPTIVE, smoothed=SMOOTHED_ADAPTIVE, mark_adaptive_target=True))
DESIGNS.add("lagchain_claims", Design(TESTS_LAGCHAIN, ("C1", "C1m", "C2", "T_low", "T_mid", "A"),
                              Footprint("A", "sparse_rl_adaptive", ("sparse_rl_low", "sparse_rl_mid"),
                                        ("T_low", "T_mid")),
                              holm_note="Holm over C1, C1m, C2, T_low, T_mid, C3, A",
                              panels=CLAIM_PANELS_LAGCHAIN, smoothed=SMOOTHED_LAGCHAIN, mark_adaptive_target=True,
                              offscale={"KV tokens held per sequence (peak)": ("dense",)}))


def evals(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if r.get(key) is not None]


def endpoint(records: list[dict], key: str, n: int = ENDPOINT_EVALS) -> float | None:
    """Mean of the last ``n`` evaluations of ``key`` in points (None with fewer)."""
    series = evals(records, key)
    return 100.0 * sum(v for _, v in series[-n:]) / n if len(series) >= n else None


def start(records: list[dict], key: str) -> float | None:
    series = evals(records, key)
    return 100.0 * series[0][1] if series and series[0][0] == 0 else None


def collapse(records: list[dict]) -> str | None:
    """Which collapse criterion the run meets first (``a``, ``b``, ``c``), else None."""
    dense = evals(records, MN.EVAL_DENSE_ACCURACY)
    best = -math.inf
    for i, (step, acc) in enumerate(dense):
        best = max(best, acc)
        if step > COLLAPSE_AFTER_STEP and 100 * (best - acc) >= COLLAPSE_DROP and all(
                100 * (best - later) >= COLLAPSE_STAY for _, later in dense[i:]):
            return "a"
    bad = [(r["step"], (r.get(MN.EVAL_DENSE_NO_ANSWER_FRAC) or 0.0) + (r.get(MN.EVAL_DENSE_TRUNCATED_FRAC) or 0.0))
           for r in sorted(records, key=lambda r: r["step"]) if r.get(MN.EVAL_DENSE_ACCURACY) is not None]
    warm = bad[0][1] if bad and bad[0][0] == 0 else 0.0
    if any(step > 0 and share >= COLLAPSE_BAD_OUTPUT and share > warm for step, share in bad):
        return "b"
    run = 0
    for r in sorted((r for r in records if r.get(MN.ROLLOUT_REPETITION_RATE) is not None), key=lambda r: r["step"]):
        run = run + 1 if r[MN.ROLLOUT_REPETITION_RATE] >= COLLAPSE_REPETITION else 0
        if run >= COLLAPSE_REPETITION_STEPS:
            return "c"
    return None


def step_mean(records: list[dict], key: str) -> float | None:
    """Mean of ``key`` over the rollout steps (step > 0) that logged it."""
    vals = [r[key] for r in records if r.get(key) is not None and r["step"] > 0]
    return sum(vals) / len(vals) if vals else None


def arm_table(records: dict[str, dict[int, list[dict]]]) -> dict[str, dict]:
    """Per arm and seed: start and endpoint per mode and class, collapse. A run with a single evaluation (the
    supervised control: its final model) has that evaluation as its endpoint, and the seed's shared warm start
    (from the other arms) as its start."""
    out: dict[str, dict] = {}
    for arm, by_seed in records.items():
        rows = {}
        for seed, recs in by_seed.items():
            keys = [MN.EVAL_DENSE_ACCURACY, MN.EVAL_SPARSE_ACCURACY]
            keys += sorted({k for r in recs for k in r if SUBSET_KEY.match(k)})
            keys += [k for k in FREE_KEYS if any(r.get(k) is not None for r in recs)]
            single = len(evals(recs, MN.EVAL_DENSE_ACCURACY)) == 1
            row = {"collapse": collapse(recs), "kv_tokens": step_mean(recs, KV_TOKENS_KEY),
                   "budget_mean": step_mean(recs, BUDGET_KEY)}
            for key in keys:
                match = SUBSET_KEY.match(key)
                name = ("_".join(match.groups()) if match else f"{key.split('/')[1]}_shortcut_free"
                        if key in FREE_KEYS else key.split("/")[1])
                row[f"{name}_start"] = None if single else start(recs, key)
                row[f"{name}_end"] = endpoint(recs, key, 1 if single else ENDPOINT_EVALS)
                row[f"{name}_final"] = endpoint(recs, key, 1)
            rows[seed] = row
        out[arm] = rows
    for rows in out.values():  # the control's start: the warm start every arm of the seed shares
        for seed, row in rows.items():
            for key in [k for k, v in row.items() if k.endswith("_start") and v is None]:
                shared = [r[seed][key] for r in out.values() if r.get(seed, {}).get(key) is not None]
                row[key] = shared[0] if shared else None
    return out


def _diffs(table: dict, test: Test) -> dict[int, float]:
    a = table.get(test.arm_a, {})
    b = table.get(test.arm_b, {}) if test.arm_b != "start" else a
    key = f"{test.mode}{test.metric}"
    key_b = f"{key}_start" if test.arm_b == "start" else f"{key}_end"
    out = {}
    for seed in sorted(set(a) & set(b)):
        x, y = a[seed].get(f"{key}_end"), b[seed].get(key_b)
        if x is not None and y is not None:
            out[seed] = x - y
    return out


def decide(table: dict, tests=TESTS, design: Design | None = None) -> dict[str, dict]:
    """Each test's statistics; the primary ones Holm-adjusted, the sequence ones in order, all decided by the
    pre-registered rule; then the manipulation check's gate and the footprint rule (``design``)."""
    design = design or Design(tuple(tests), ("C1", "C2a", "C2b"))
    results = {}
    for t in design.tests:
        d = _diffs(table, t)
        if len(d) < 2:
            results[t.name] = {"test": t.__dict__, "seeds": sorted(d), "verdict": "not run (fewer than 2 seeds)"}
            continue
        s = paired_summary(list(d.values()), "greater", t.margin)
        against = paired_summary(list(d.values()), "less", t.margin).p_sign_flip
        results[t.name] = {"test": t.__dict__, "seeds": sorted(d), **s.as_dict(), "p_against": against}
    primary = {n: r["p_sign_flip"] for n, r in results.items()
               if r["test"]["primary"] and "p_sign_flip" in r}
    adjusted = holm(primary)
    stopped = None
    for name, r in results.items():
        if "p_sign_flip" not in r:
            continue
        margin = r["margin"]
        if name in adjusted:
            r["p_holm"] = adjusted[name]
            ok = adjusted[name] < ALPHA and r["bound"] > margin
        else:
            ok = r["p_sign_flip"] < ALPHA and r["bound"] > margin
        r["verdict"] = "supported" if ok else ("against" if r["p_against"] < ALPHA else "not supported")
        if r["test"].get("sequence"):
            if stopped is not None:
                r["verdict"] = f"not reached (the sequence stopped at {stopped}; would be: {r['verdict']})"
            elif not ok:
                stopped = name
    check = results.get("check", {})
    if check.get("verdict") != "supported":
        for name in design.gated:
            if name in results and "p_sign_flip" in results[name]:
                results[name]["verdict"] = ("not testable (dense RL did not learn; would be: "
                                            f"{results[name]['verdict']})")
    if design.footprint is not None:
        footprint_rule(table, results, design.footprint)
    return results


def arm_footprint(table: dict, arm: str, seeds: list[int] | None = None) -> float | None:
    """Mean over ``seeds`` (None: all) of the arm's per-seed mean KV tokens per sequence."""
    rows = table.get(arm, {})
    vals = [rows[s]["kv_tokens"] for s in (seeds if seeds is not None else rows) if s in rows
            and rows[s].get("kv_tokens") is not None]
    return sum(vals) / len(vals) if vals else None


def footprint_rule(table: dict, results: dict, rule: Footprint) -> None:
    """The adaptive arm's verdict (``Footprint``), written into ``results[rule.test]`` as ``footprint`` and a
    ``verdict`` that requires both parts."""
    r = results.get(rule.test)
    if r is None or "p_sign_flip" not in r:
        return
    tracking = [arm for arm, t in zip(rule.ladder, rule.ladder_tests)
                if results.get(t, {}).get("verdict") == "supported"]
    reference = tracking[0] if tracking else rule.ladder[-1]
    ours, theirs = arm_footprint(table, rule.arm, r["seeds"]), arm_footprint(table, reference, r["seeds"])
    small = ours is not None and theirs is not None and ours <= theirs
    r["footprint"] = {"arm_kv_tokens": ours, "reference_arm": reference, "reference_kv_tokens": theirs,
                      "reference_tracks_dense": bool(tracking), "no_larger": small}
    tracks = r["verdict"]
    if tracks == "supported":
        r["verdict"] = "supported" if small else "not supported (tracks dense, but a larger KV footprint than " \
                                                 f"{reference})"
    r["tracking_verdict"] = tracks

RENAMED_DESIGNS: dict[str, str] = {"issue20": "cpu_claims", "issue27": "adaptive_claims", "issue39": "lagchain_claims"}
"""The designs' names before they were named after their studies (saved experiment configs and ``analysis.json``
files hold them): read as the new names."""


def design_name(name: str) -> str:
    """``name``, or its current name if it is a design's earlier one (``RENAMED_DESIGNS``)."""
    return RENAMED_DESIGNS.get(name, name)
