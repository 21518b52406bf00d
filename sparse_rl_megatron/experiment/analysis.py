"""The pre-registered analysis (docs/experiments.md, issue 20): endpoints, collapse, the four primary tests with
Holm, the manipulation check, and the secondary comparisons; written as ``analysis.json`` / ``analysis.md``.

Endpoint of a run in a mode: the mean of its last ``ENDPOINT_EVALS`` evaluations of greedy held-out accuracy
(points). A paired difference takes, per seed, one arm's endpoint minus another's (the arms of a seed share
the warm start). Only seeds with every arm a test needs complete enter that test.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from sparse_rl_megatron.experiment.stats import holm, paired_summary

ENDPOINT_EVALS = 3
ANALYSIS_JSON = "analysis.json"
ANALYSIS_MD = "analysis.md"
ALPHA = 0.05
COLLAPSE_AFTER_STEP = 50
COLLAPSE_DROP, COLLAPSE_STAY = 15.0, 10.0
"""Collapse (a): after step 50 dense accuracy falls >= 15 points below its running max and stays >= 10 below."""
COLLAPSE_BAD_OUTPUT = 0.25
"""Collapse (b): dense no-answer + truncated >= 25% at some evaluation."""
COLLAPSE_REPETITION, COLLAPSE_REPETITION_STEPS = 0.02, 10
"""Collapse (c): rollout repeated-4-gram rate >= 0.02 for 10 consecutive steps."""
FREE_KEYS = ("eval/dense/shortcut_free_accuracy", "eval/sparse/shortcut_free_accuracy")
"""Accuracy on the records no trivial policy answers (tasks that flag them; ``eval/subsets.py``): rows
``<mode>_shortcut_free_{start,end,final}``, shown next to the classes."""
SUBSET_KEY = re.compile(r"^eval/(dense|sparse)/[^/]+/subset_([^/]+)/accuracy$")


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


TESTS = (
    Test("C1", "naive sparse rollouts degrade GRPO", "dense", "naive"),
    Test("C2a", "Sparse-RL tracks dense rollouts (within 5 points)", "sparse_rl", "dense", margin=-5.0),
    Test("C2b", "the correction helps (Sparse-RL beats naive)", "sparse_rl", "naive"),
    Test("C3", "Sparse-RL is more robust under sparse inference", "sparse_rl", "dense", mode="sparse"),
    Test("check", "dense RL learns (manipulation check)", "dense", "start", primary=False),
    Test("dose1", "dose: dense beats naive at B_h", "dense", "naive_harsh", primary=False),
    Test("dose2", "dose: naive at B* beats naive at B_h", "naive", "naive_harsh", primary=False),
)


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
    dense = evals(records, "eval/dense/accuracy")
    best = -math.inf
    for i, (step, acc) in enumerate(dense):
        best = max(best, acc)
        if step > COLLAPSE_AFTER_STEP and 100 * (best - acc) >= COLLAPSE_DROP and all(
                100 * (best - later) >= COLLAPSE_STAY for _, later in dense[i:]):
            return "a"
    for r in records:
        bad = (r.get("eval/dense/no_answer_frac") or 0.0) + (r.get("eval/dense/truncated_frac") or 0.0)
        if r.get("eval/dense/accuracy") is not None and bad >= COLLAPSE_BAD_OUTPUT:
            return "b"
    run = 0
    for r in sorted((r for r in records if r.get("rollout/repetition_rate") is not None), key=lambda r: r["step"]):
        run = run + 1 if r["rollout/repetition_rate"] >= COLLAPSE_REPETITION else 0
        if run >= COLLAPSE_REPETITION_STEPS:
            return "c"
    return None


def arm_table(records: dict[str, dict[int, list[dict]]]) -> dict[str, dict]:
    """Per arm and seed: start and endpoint per mode and class, collapse. A run with a single evaluation (the
    supervised control: its final model) has that evaluation as its endpoint, and the seed's shared warm start
    (from the other arms) as its start."""
    out: dict[str, dict] = {}
    for arm, by_seed in records.items():
        rows = {}
        for seed, recs in by_seed.items():
            keys = ["eval/dense/accuracy", "eval/sparse/accuracy"]
            keys += sorted({k for r in recs for k in r if SUBSET_KEY.match(k)})
            keys += [k for k in FREE_KEYS if any(r.get(k) is not None for r in recs)]
            single = len(evals(recs, "eval/dense/accuracy")) == 1
            row = {"collapse": collapse(recs)}
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
    key_b = f"{test.mode}_start" if test.arm_b == "start" else f"{test.mode}_end"
    out = {}
    for seed in sorted(set(a) & set(b)):
        x, y = a[seed].get(f"{test.mode}_end"), b[seed].get(key_b)
        if x is not None and y is not None:
            out[seed] = x - y
    return out


def decide(table: dict, tests=TESTS) -> dict[str, dict]:
    """Each test's statistics; the primary ones Holm-adjusted and decided by the pre-registered rule."""
    results = {}
    for t in tests:
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
    check = results.get("check", {})
    if check.get("verdict") != "supported":
        for name in ("C1", "C2a", "C2b"):
            if name in results and "p_sign_flip" in results[name]:
                results[name]["verdict"] = ("not testable (dense RL did not learn; would be: "
                                            f"{results[name]['verdict']})")
    return results


def write_analysis(out: Path, records: dict[str, dict[int, list[dict]]], extra: dict | None = None) -> Path:
    """``analysis.json`` and ``analysis.md`` of ``records`` (``{arm: {seed: metrics records}}``)."""
    from sparse_rl_megatron.experiment.analysis_report import analysis_markdown

    table = arm_table(records)
    result = {"arms": table, "tests": decide(table), **(extra or {})}
    (out / ANALYSIS_JSON).write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / ANALYSIS_MD).write_text(analysis_markdown(result))
    return out / ANALYSIS_MD


def write_full_analysis(cfg, records: dict) -> Path:
    """``analysis.md`` / ``.json`` with the study's summaries, in the experiment directory."""
    from sparse_rl_megatron.experiment.analysis_report import study_summary

    return write_analysis(Path(cfg.experiment.out), records, study_summary(cfg, records))
