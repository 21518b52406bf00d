"""``--stage budgets``: the pre-registered choice of the main KV budget B* and the dose budget B_h.

Per seed, ``sparse-rl mismatch`` (a child process, the trainer's own rollout and recompute) samples the run's
first ``budget_rule.prompts`` prompts x ``samples`` at T = 1 from the seed's warm start, dense and at every
candidate budget, and counts what Sparse-RL's veto would drop. Pooled over the seeds (the mean of the seeds'
vetoed fractions; the ratio of the mean rewards), B* is the smallest candidate with would-be veto <=
``max_would_veto`` and sparse / dense reward >= ``min_reward_ratio``; if none passes, the largest candidate.
B_h = max(``min_budget``, B* // 2) (``kind: veto_reward``, issue 20).

``kind: contamination`` (issue 27, as amended after the pilot seed's measurement): the contamination share of a
candidate is the mean over the seeds of the share of sequences with any token rho < 0.5
(``sparse/contaminated_frac``), and its level share the largest such share at it or any larger candidate. The
levels, from the smallest target up, each get the candidate whose level share is nearest the target (a tie: the
larger budget) among the candidates smaller than the previous level's budget (distinct, ordered budgets);
B* = the ``main_level``'s budget, B_h = the smallest level budget. The choice goes to ``<out>/budget_rule.json``; with
``experiment.budgets_from_rule`` the arms and the study read it from there (``apply_budget_rule``).
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import yaml

from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.experiment.arm_dirs import arm_train_config, seed_dir
from sparse_rl_megatron.experiment.arms import ArmRun
from sparse_rl_megatron.experiment.config import BudgetRuleConfig, ExperimentConfig
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.utils.config_io import to_dict
from sparse_rl_megatron.utils.errors import UserError

RULE_FILE = "budget_rule.json"
STUDY_DIR = "budgets"
STUDY_FILE = "mismatch.json"
VETO_KEY = MN.SPARSE_VETOED_SEQ_FRAC
REWARD_KEY = MN.ROLLOUT_REWARD_MEAN
CONTAMINATION_KEY = MN.SPARSE_CONTAMINATED_FRAC


def mismatch_command(recipe: Path, output: Path, budgets: list[int], prompts: int, samples: int) -> list[str]:
    """``sparse-rl mismatch`` on ``recipe`` (its model, data, sampling, compressor) at ``budgets``."""
    return [sys.executable, "-m", "sparse_rl_megatron.cli", "mismatch", "--config", str(recipe),
            "--budgets", ",".join(map(str, budgets)), "--prompts", str(prompts), "--samples", str(samples),
            "--output", str(output), "log.progress=false"]


def run_mismatch(train_data: dict, work: Path, output: Path, budgets: list[int], prompts: int, samples: int,
                 log: Callable[[str], None]) -> dict:
    """Run (once: an existing ``output`` is read back) a mismatch study of the train recipe ``train_data`` (a
    ``TrainConfig`` dict) with ``work`` as its run directory; returns the results document."""
    if output.is_file():
        return json.loads(output.read_text())
    work.mkdir(parents=True, exist_ok=True)
    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**train_data, "run_dir": str(work)}, sort_keys=False))
    cmd = mismatch_command(recipe, output.with_suffix(".partial.json"), budgets, prompts, samples)
    log(" ".join(cmd[2:]))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (work / "mismatch.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise UserError(f"sparse-rl mismatch failed (exit {proc.returncode}); see {work / 'mismatch.log'}: "
                        f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    output.with_suffix(".partial.json").rename(output)
    return json.loads(output.read_text())


def row_stats(document: dict) -> dict[str, dict[str, float]]:
    """``{label: {"veto", "reward", "contaminated"}}`` of a mismatch results document (``dense``,
    ``<method> B=<b>``)."""
    return {row["label"]: {"veto": row["stats"].get(VETO_KEY), "reward": row["stats"].get(REWARD_KEY),
                           "contaminated": row["stats"].get(CONTAMINATION_KEY)}
            for row in document["rows"]}


def _pooled(per_seed: dict[int, dict[str, dict[str, float]]], label: str, key: str) -> float:
    """The mean over the seeds of one ``row_stats`` value (``key``) of the row ``label``."""
    return sum(per_seed[s][label][key] for s in sorted(per_seed)) / len(per_seed)


def choose_budgets(per_seed: dict[int, dict[str, dict[str, float]]], method: str, rule: BudgetRuleConfig) -> dict:
    """The rule of the module docstring over the seeds' ``row_stats``; returns the choice and the table."""
    seeds = sorted(per_seed)
    dense_reward = _pooled(per_seed, "dense", "reward")
    table = []
    chosen = None
    for budget in rule.candidates:
        label = f"{method} B={budget}"
        veto, reward = _pooled(per_seed, label, "veto"), _pooled(per_seed, label, "reward")
        ratio = reward / dense_reward if dense_reward > 0 else 0.0
        passes = veto <= rule.max_would_veto and ratio >= rule.min_reward_ratio
        table.append({"budget": budget, "would_veto": veto, "reward": reward, "reward_ratio": ratio,
                      "passes": passes, "per_seed_veto": {s: per_seed[s][label]["veto"] for s in seeds}})
        if passes and chosen is None:
            chosen = budget
    fallback = chosen is None
    main = rule.candidates[-1] if fallback else chosen
    return {"budget": main, "harsh_budget": max(rule.min_budget, main // 2), "fallback_to_largest": fallback,
            "dense_reward": dense_reward, "seeds": seeds, "method": method, "rule": to_dict(rule), "table": table}


def choose_levels(per_seed: dict[int, dict[str, dict[str, float]]], method: str, rule: BudgetRuleConfig) -> dict:
    """``kind: contamination`` over the seeds' ``row_stats``: the level budgets (the module docstring's rule),
    B* and B_h, and the table.

    A budget's share is the pooled contamination at it or at any larger candidate (the largest of them: the
    contamination curve made non-increasing in B, so a level "holds" its share at every larger budget; measured
    curves are not monotone at small B, issue 27's pilot seed: 93%, 14%, 25%, 1% at B = 3, 4, 5, 6). The levels
    are taken from the smallest target up (the largest budget first), each among the candidates smaller than the
    previous level's budget, so they are distinct and ordered; when none is left, the level gets the previous
    level's budget and is listed in ``collapsed``."""
    seeds = sorted(per_seed)
    dense_reward = _pooled(per_seed, "dense", "reward")
    table = []
    for budget in rule.candidates:
        label = f"{method} B={budget}"
        reward = _pooled(per_seed, label, "reward")
        table.append({"budget": budget, "contaminated": _pooled(per_seed, label, "contaminated"), "reward": reward,
                      "reward_ratio": reward / dense_reward if dense_reward > 0 else 0.0,
                      "would_veto": _pooled(per_seed, label, "veto"),
                      "per_seed_contaminated": {s: per_seed[s][label]["contaminated"] for s in seeds}})
    worst = 0.0
    for row in reversed(table):  # the non-increasing envelope: the worst share at this budget or a larger one
        worst = max(worst, row["contaminated"])
        row["contaminated_at_or_above"] = worst
    levels, collapsed, below = {}, [], None
    for level, target in sorted(rule.levels.items(), key=lambda kv: (kv[1], kv[0])):
        rows = [r for r in table if below is None or r["budget"] < below]
        if not rows:
            levels[level] = below
            collapsed.append(level)
            continue
        # the nearest its target; a tie: the larger budget
        levels[level] = below = max(rows, key=lambda r: (-round(abs(r["contaminated_at_or_above"] - target), 12),
                                                         r["budget"]))["budget"]
    levels = {k: levels[k] for k in rule.levels}
    return {"budget": levels[rule.main_level], "harsh_budget": min(levels.values()), "levels": levels,
            "collapsed": collapsed, "fallback_to_largest": False, "dense_reward": dense_reward, "seeds": seeds,
            "method": method, "rule": to_dict(rule), "table": table}


def study_caches(base: CompressionConfig, budget: int, harsh: int) -> list[CompressionConfig]:
    """The final models' other caches: R-KV at 2 B* and at B_h, SnapKV and StreamingLLM at B* (the other fields
    as the main cache)."""
    return [dataclasses.replace(base, method="rkv", budget=2 * budget),
            dataclasses.replace(base, method="rkv", budget=harsh),
            dataclasses.replace(base, method="snapkv", budget=budget),
            dataclasses.replace(base, method="streamingllm", budget=budget)]


def apply_budget_rule(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with B* (rollout and evaluation caches), B_h, the level budgets and the study's caches of
    ``<out>/budget_rule.json`` when ``experiment.budgets_from_rule``; unchanged otherwise."""
    if not cfg.experiment.budgets_from_rule:
        return cfg
    path = Path(cfg.experiment.out) / RULE_FILE
    if not path.is_file():
        raise UserError(f"experiment.budgets_from_rule: {path} does not exist; run the same command with "
                        f"--stage budgets first (it chooses B* and B_h by the pre-registered rule)")
    choice = json.loads(path.read_text())
    b, h = int(choice["budget"]), int(choice["harsh_budget"])
    levels = {k: int(v) for k, v in choice.get("levels", {}).items()}
    train = cfg.train
    rollout = dataclasses.replace(train.rollout, compression=dataclasses.replace(train.rollout.compression, budget=b))
    main_eval = train.eval.compression or train.rollout.compression
    evaluation = dataclasses.replace(train.eval, compression=dataclasses.replace(main_eval, budget=b))
    study = cfg.experiment.study
    if not study.caches:
        study = dataclasses.replace(study, caches=study_caches(train.rollout.compression, b, h))
    section = dataclasses.replace(cfg.experiment, harsh_budget=h, study=study,
                                  level_budgets={**cfg.experiment.level_budgets, **levels})
    return dataclasses.replace(cfg, experiment=section, train=dataclasses.replace(train, rollout=rollout,
                                                                                   eval=evaluation))


def run_budget_stage(cfg: ExperimentConfig, warm_dirs: dict[int, Path], log: Callable[[str], None]) -> dict:
    """Mismatch on every seed's warm start, then the rule; writes ``<out>/budget_rule.json`` (an existing one is
    kept: the choice is made once)."""
    out = Path(cfg.experiment.out)
    rule = cfg.experiment.budget_rule
    method = cfg.train.rollout.compression.method
    per_seed = {}
    for seed, warm in warm_dirs.items():
        train_cfg = arm_train_config(cfg, ArmRun(STUDY_DIR, "sparse_rl"), seed, warm)
        work = seed_dir(cfg, seed) / STUDY_DIR
        doc = run_mismatch(to_dict(train_cfg), work, work / STUDY_FILE, rule.candidates, rule.prompts,
                           rule.samples, log)
        per_seed[seed] = row_stats(doc)
    path = out / RULE_FILE
    if path.is_file():
        log(f"budget rule: {path} exists, kept")
        return json.loads(path.read_text())
    pooled = rule.seeds if rule.seeds is not None else cfg.experiment.seeds
    for seed in pooled:
        doc = seed_dir(cfg, seed) / STUDY_DIR / STUDY_FILE
        if seed not in per_seed and doc.is_file():
            per_seed[seed] = row_stats(json.loads(doc.read_text()))
    missing = [s for s in pooled if s not in per_seed]
    if missing:
        log(f"budget rule: seeds {missing} are not measured yet; the rule is chosen once all of {pooled} are")
        return {}
    per_seed = {s: per_seed[s] for s in pooled}
    choice = (choose_levels if rule.kind == "contamination" else choose_budgets)(per_seed, method, rule)
    path.write_text(json.dumps(choice, indent=1) + "\n")
    for row in choice["table"]:
        log(f"budget {row['budget']}: would-be veto {row['would_veto']:.3f}, reward ratio {row['reward_ratio']:.3f}"
            + (f", contaminated {row['contaminated']:.3f}" if "contaminated" in row else "")
            + (" (passes)" if row.get("passes") else ""))
    if "levels" in choice:
        log(f"budget rule: levels {choice['levels']}"
            + (f" (collapsed: {', '.join(choice['collapsed'])})" if choice.get("collapsed") else ""))
    log(f"budget rule: B* = {choice['budget']}, B_h = {choice['harsh_budget']}"
        f"{' (no candidate passed: the largest)' if choice['fallback_to_largest'] else ''} -> {path}")
    return choice
