"""``analysis.md``: the pre-registered analysis as tables (``analysis.py`` computes it), and the study's
summaries (compounding test, other caches) that ``study_summary`` reads from the study files."""
from __future__ import annotations

import json
import math
from pathlib import Path

ARM_ORDER = ("dense", "naive", "sparse_rl", "naive_harsh", "sft")


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
            + " | ".join(f"{s} dense start → endpoint" for s in subsets) + " | collapses |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name in names:
        rows = list(arms[name].values())
        cells = [f"{_ms([r.get(f'{m}_start') for r in rows])} → {_ms([r.get(f'{m}_end') for r in rows])}"
                 for m in ("dense", "sparse")]
        cells += [f"{_ms([r.get(f'dense_{s}_start') for r in rows])} → {_ms([r.get(f'dense_{s}_end') for r in rows])}"
                  for s in subsets]
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
    return "\n".join(lines) + "\n"


def study_summary(cfg, records: dict) -> dict:
    """The compounding test and the other caches, per arm and seed, from the study files (absent: empty)."""
    from sparse_rl_megatron.experiment.runner import seed_dir
    from sparse_rl_megatron.experiment.study import CACHES_FILE, STUDY_DIR, mismatch_file

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
                        "veto": row.get("sparse/vetoed_seq_frac"), "rho_p1": row.get("rho/p1"),
                        "reward": row.get("rollout/reward_mean")}
            path = sdir / arm / STUDY_DIR / CACHES_FILE
            if path.is_file():
                caches.setdefault(arm, {})[seed] = {c: 100 * m["eval/sparse/accuracy"]
                                                    for c, m in json.loads(path.read_text()).items()}
    return {"compounding": comp, "caches": caches}


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
            "\n## Per seed, sparse endpoint\n", per_seed_markdown(result["arms"], "sparse"),
            "\n## Tests (pre-registered; Holm over C1, C2a, C2b, C3)\n", tests_markdown(result["tests"])]
    if "compounding" in result:
        text += ["\n## Compounding test (mismatch at B* on the same prompts; veto in %)\n",
                 compounding_markdown(result["compounding"]),
                 "\n## Final models under other caches (greedy accuracy, points)\n", caches_markdown(result["caches"])]
    return "".join(text)


def write_full_analysis(cfg, records: dict) -> Path:
    """``analysis.md`` / ``.json`` with the study's summaries, in the experiment directory."""
    from sparse_rl_megatron.experiment.analysis import write_analysis

    return write_analysis(Path(cfg.experiment.out), records, study_summary(cfg, records))
