"""``analysis.md``: the pre-registered analysis as tables (``analysis.py`` computes it), and the study's
summaries (compounding test, other caches) that ``study_summary`` reads from the study files."""
from __future__ import annotations

import json
import math
from pathlib import Path

from sparse_rl_megatron.experiment.analysis import ANALYSIS_JSON, ANALYSIS_MD, DESIGNS, arm_table, decide, design_name as current_name
from sparse_rl_megatron.experiment.arm_dirs import seed_dir
from sparse_rl_megatron.experiment.stats import paired_summary
from sparse_rl_megatron.experiment.study import CACHES_FILE, STUDY_DIR, mismatch_file
from sparse_rl_megatron.observability import metric_names as MN

ARM_ORDER = ("dense", "naive", "sparse_rl", "naive_harsh", "sft", "naive_low", "sparse_rl_low", "sparse_rl_mid",
             "sparse_rl_high", "sparse_rl_adaptive")


def _f(x, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _p(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _mean(values):
    vals = [v for v in values if v is not None]
    return (sum(vals) / len(vals), (sum((v - sum(vals) / len(vals)) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
            if len(vals) > 1 else None) if vals else (None, None)


def _ms(values) -> str:
    m, s = _mean(values)
    return "-" if m is None else _f(m) + (f" ± {_f(s)}" if s is not None else "")


def arms_markdown(arms: dict) -> str:
    names = [a for a in ARM_ORDER if a in arms] + [a for a in arms if a not in ARM_ORDER]
    subsets = sorted({k.split("_", 1)[1].rsplit("_", 1)[0] for rows in arms.values() for row in rows.values()
                      for k in row if k.startswith("dense_") and k.endswith("_end")} - {"end"})
    head = ("| arm | seeds | dense start → endpoint | sparse start → endpoint | "
            + " | ".join(f"{s} dense start → endpoint" for s in subsets) + " | KV tokens / sequence | mean budget | "
            "collapses |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name in names:
        rows = list(arms[name].values())
        cells = [f"{_ms([r.get(f'{m}_start') for r in rows])} → {_ms([r.get(f'{m}_end') for r in rows])}"
                 for m in ("dense", "sparse")]
        cells += [f"{_ms([r.get(f'dense_{s}_start') for r in rows])} → {_ms([r.get(f'dense_{s}_end') for r in rows])}"
                  for s in subsets]
        cells += [_ms([r.get("kv_tokens") for r in rows]), _ms([r.get("budget_mean") for r in rows])]
        collapses = [r["collapse"] for r in rows if r.get("collapse")]
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + f" | {len(collapses)}"
                     + (f" ({', '.join(collapses)})" if collapses else "") + " |")
    return "\n".join(lines) + "\n"


def per_seed_markdown(arms: dict, mode: str = "dense") -> str:
    names = [a for a in ARM_ORDER if a in arms]
    seeds = sorted({s for rows in arms.values() for s in rows})
    head = f"| arm ({mode} endpoint) | " + " | ".join(f"seed {s}" for s in seeds) + " |"
    lines = [head, "|" + " --- |" * (len(seeds) + 1)]
    first = next(iter(arms.values()))
    lines.append("| start | " + " | ".join(_f(first.get(s, {}).get(f"{mode}_start")) for s in seeds) + " |")
    for name in names:
        lines.append(f"| {name} | " + " | ".join(_f(arms[name].get(s, {}).get(f"{mode}_end")) for s in seeds) + " |")
    return "\n".join(lines) + "\n"


def tests_markdown(tests: dict) -> str:
    head = ("| test | claim | n | per-seed differences (points) | mean | 95% t CI | one-sided 95% bound | margin | "
            "sign-flip p | Holm p | verdict |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name, r in tests.items():
        if "mean" not in r:
            lines.append(f"| {name} | {r['test']['claim']} | - | - | - | - | - | - | - | - | {r['verdict']} |")
            continue
        diffs = ", ".join(_f(d) for d in r["diffs"])
        lines.append(f"| {name} | {r['test']['claim']} | {r['n']} | {diffs} | {_f(r['mean'])} | "
                     f"[{_f(r['ci_low'])}, {_f(r['ci_high'])}] | {_f(r['bound'])} | {_f(r['margin'])} | "
                     f"{_p(r['p_sign_flip'])} | {_p(r.get('p_holm'))} | {r['verdict']} |")
    for name, r in tests.items():
        fp = r.get("footprint")
        if fp:
            why = ("the smallest fixed budget that tracks dense" if fp["reference_tracks_dense"]
                   else "no fixed budget tracks dense: the largest")
            lines.append(f"\n{name}, footprint: {_f(fp['arm_kv_tokens'])} KV tokens per sequence against "
                         f"{_f(fp['reference_kv_tokens'])} for {fp['reference_arm']} ({why}); no larger: "
                         f"{fp['no_larger']}; tracking alone: {r.get('tracking_verdict')}")
    return "\n".join(lines) + "\n"


def study_summary(cfg, records: dict) -> dict:
    """The compounding test and the other caches, per arm and seed, from the study files (absent: empty)."""
    steps = [0, *cfg.experiment.study.checkpoint_steps]
    comp, caches = {}, {}
    for arm, by_seed in records.items():
        for seed in by_seed:
            sdir = seed_dir(cfg, seed)
            for step in steps:
                path = mismatch_file(sdir / arm, sdir, step)
                if path.is_file():
                    row = json.loads(path.read_text())["rows"][-1]["stats"]
                    comp.setdefault(arm, {}).setdefault(seed, {})[step] = {
                        "veto": row.get(MN.SPARSE_VETOED_SEQ_FRAC), "rho_p1": row.get(MN.RHO_P1),
                        "reward": row.get(MN.ROLLOUT_REWARD_MEAN)}
            path = sdir / arm / STUDY_DIR / CACHES_FILE
            if path.is_file():
                caches.setdefault(arm, {})[seed] = {c: 100 * m[MN.EVAL_SPARSE_ACCURACY]
                                                    for c, m in json.loads(path.read_text()).items()}
    comp = {arm: by_seed for arm, by_seed in comp.items() if any(k for v in by_seed.values() for k in v)}
    decided = DESIGNS.get(cfg.experiment.analysis).study_tests
    return {"compounding": comp, "caches": caches,
            "study_tests": study_tests(comp, caches, steps[-1]) if decided else {}}


def study_tests(comp: dict, caches: dict, last: int) -> dict:
    """The pre-registered secondary tests of the study: per seed Delta = value(last step) - value(step 0) of the
    would-be veto (points) and of log10 rho p1; Delta(naive) - Delta(sparse_rl) (veto: H1 > 0) and
    Delta(sparse_rl) - Delta(naive) (log10 p1: H1 > 0); and per cache sparse_rl - dense accuracy (H1 > 0)."""
    def delta(arm, key, fn):
        out = {}
        for seed, v in comp.get(arm, {}).items():
            if 0 in v and last in v and v[0][key] is not None and v[last][key] is not None:
                out[seed] = fn(v[last][key]) - fn(v[0][key])
        return out

    tests = {}
    log10 = lambda x: math.log10(max(x, 1e-30))  # noqa: E731
    for name, key, fn, a, b in (("veto_growth_naive_minus_sparse_rl", "veto", lambda x: 100 * x, "naive", "sparse_rl"),
                                ("log10_p1_change_sparse_rl_minus_naive", "rho_p1", log10, "sparse_rl", "naive")):
        da, db = delta(a, key, fn), delta(b, key, fn)
        seeds = sorted(set(da) & set(db))
        if len(seeds) >= 2:
            tests[name] = {"seeds": seeds, **paired_summary([da[s] - db[s] for s in seeds]).as_dict(),
                           "mean_delta": {a: sum(da[s] for s in seeds) / len(seeds),
                                          b: sum(db[s] for s in seeds) / len(seeds)}}
    names = sorted({c for v in caches.get("dense", {}).values() for c in v})
    for cache in names:
        seeds = sorted(set(caches.get("sparse_rl", {})) & set(caches.get("dense", {})))
        diffs = [caches["sparse_rl"][s][cache] - caches["dense"][s][cache] for s in seeds
                 if cache in caches["sparse_rl"][s] and cache in caches["dense"][s]]
        if len(diffs) >= 2:
            tests[f"cache {cache}: sparse_rl - dense"] = {"seeds": seeds, **paired_summary(diffs).as_dict()}
    return tests


def study_tests_markdown(tests: dict) -> str:
    if not tests:
        return "(not run)\n"
    head = "| comparison | n | per-seed values | mean | 95% t CI | one-sided 95% lower bound | sign-flip p (H1 > 0) |"
    lines = [head, "|" + " --- |" * 7]
    for name, r in tests.items():
        lines.append(f"| {name} | {r['n']} | {', '.join(_f(d, 2) for d in r['diffs'])} | {_f(r['mean'], 2)} | "
                     f"[{_f(r['ci_low'], 2)}, {_f(r['ci_high'], 2)}] | {_f(r['bound'], 2)} | {_p(r['p_sign_flip'])} |")
    return "\n".join(lines) + "\n"


def compounding_markdown(comp: dict) -> str:
    if not comp:
        return "(not run)\n"
    steps = sorted({st for by_seed in comp.values() for v in by_seed.values() for st in v})
    head = "| arm | seeds | " + " | ".join(f"would-be veto, step {s}" for s in steps) + " | " + " | ".join(
        f"rho p1, step {s}" for s in steps) + " |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for arm in [a for a in ARM_ORDER if a in comp]:
        vals = comp[arm].values()
        cells = [_ms([100 * v[s]["veto"] if s in v and v[s]["veto"] is not None else None for v in vals])
                 for s in steps]
        cells += [_f(_mean([v[s]["rho_p1"] for v in vals if s in v])[0], 5) for s in steps]
        lines.append(f"| {arm} | {len(comp[arm])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def caches_markdown(caches: dict) -> str:
    if not caches:
        return "(not run)\n"
    names = sorted({c for by_seed in caches.values() for v in by_seed.values() for c in v})
    head = "| arm | seeds | " + " | ".join(names) + " |"
    lines = [head, "|" + " --- |" * (len(names) + 2)]
    for arm in [a for a in ARM_ORDER if a in caches]:
        vals = caches[arm].values()
        lines.append(f"| {arm} | {len(caches[arm])} | " + " | ".join(_ms([v.get(c) for v in vals]) for c in names)
                     + " |")
    return "\n".join(lines) + "\n"


def analysis_markdown(result: dict) -> str:
    text = ["## Arms (greedy held-out accuracy, points: mean ± sd over seeds; endpoint = mean of the last 3 "
            "evaluations)\n", arms_markdown(result["arms"]),
            "\n## Per seed, dense endpoint\n", per_seed_markdown(result["arms"], "dense"),
            "\n## Per seed, sparse endpoint\n", per_seed_markdown(result["arms"], "sparse")]
    if any(k.endswith("_shortcut_free_end") for rows in result["arms"].values() for r in rows.values() for k in r):
        text += ["\n## Per seed, shortcut-free dense endpoint\n",
                 per_seed_markdown(result["arms"], "dense_shortcut_free"),
                 "\n## Per seed, shortcut-free sparse endpoint\n",
                 per_seed_markdown(result["arms"], "sparse_shortcut_free")]
    text += [f"\n## Tests (pre-registered; {result.get('holm_note') or 'Holm over C1, C2a, C2b, C3'})\n",
             tests_markdown(result["tests"])]
    if "compounding" in result:
        text += ["\n## Compounding test (mismatch at B* on the same prompts; veto in %)\n",
                 compounding_markdown(result["compounding"]),
                 "\n## Final models under other caches (greedy accuracy, points)\n", caches_markdown(result["caches"]),
                 "\n## Study tests (secondary, unadjusted)\n",
                 study_tests_markdown(result.get("study_tests", {})) if DESIGNS.get(current_name(result["design"])).study_tests
                 else "(none registered for this design: its checkpoint study is descriptive)\n"]
    return "".join(text)


def write_analysis(out: Path, records: dict[str, dict[int, list[dict]]], extra: dict | None = None,
                   design_name: str = "cpu_claims") -> Path:
    """``analysis.json`` and ``analysis.md`` of ``records`` (``{arm: {seed: metrics records}}``)."""
    table = arm_table(records)
    registered = DESIGNS.get(current_name(design_name))
    result = {"arms": table, "tests": decide(table, design=registered), "design": current_name(design_name),
              "holm_note": registered.holm_note, **(extra or {})}
    (out / ANALYSIS_JSON).write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / ANALYSIS_MD).write_text(analysis_markdown(result))
    return out / ANALYSIS_MD


def write_full_analysis(cfg, records: dict) -> Path:
    """``analysis.md`` / ``.json`` with the study's summaries, in the experiment directory."""
    return write_analysis(Path(cfg.experiment.out), records, study_summary(cfg, records), cfg.experiment.analysis)
