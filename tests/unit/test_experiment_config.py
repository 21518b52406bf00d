"""``sparse-rl experiment`` without running anything: the recipes load, the arms are the right overrides of
one base recipe, bad choices name their field, the control's length matches CPU time, and the table's
statistics are exact."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparse_rl_megatron.experiment.arms import arm_runs
from sparse_rl_megatron.experiment.config import ExperimentConfig
from sparse_rl_megatron.experiment.control import control_steps
from sparse_rl_megatron.experiment.results import mean_spread, seed_summary
from sparse_rl_megatron.experiment.runner import ARM_DONE, arm_train_config
from sparse_rl_megatron.utils.config_io import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "experiments" / "cpu_claims.yaml"


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs" / "experiments").glob("*.yaml")), ids=lambda p: p.name)
def test_every_experiment_recipe_loads_and_each_arm_trains_the_seeds_warm_start_in_a_directory_of_its_own(recipe):
    cfg = load_config(ExperimentConfig, recipe)
    runs = arm_runs(cfg.experiment.arms, cfg.experiment.budgets)
    arms = [arm_train_config(cfg, run, 5, "/models/warm") for run in runs]
    assert runs and len({a.run_dir for a in arms}) == len(runs)
    assert all(a.model_path == "/models/warm" and a.seed == 5 and a.warm_start == {} for a in arms)
    assert {a.data.dataset for a in arms} == {cfg.train.data.dataset}


def test_arms_override_one_base_recipe_and_share_the_warm_start_and_the_sparse_evaluation(tmp_path):
    cfg = load_config(ExperimentConfig, RECIPE, [f"experiment.out={tmp_path}", "experiment.budgets=[4]"])
    runs = arm_runs(cfg.experiment.arms, cfg.experiment.budgets)
    assert [r.name for r in runs] == ["dense", "naive", "sparse_rl", "sparse_rl_snapkv", "sft", "naive_B4",
                                      "sparse_rl_B4"]
    cfgs = {r.name: arm_train_config(cfg, r, 3, tmp_path / "warm") for r in runs}
    kv = {n: (c.rollout.compression.method, c.rollout.compression.budget, c.correction.mode) for n, c in cfgs.items()}
    assert kv["dense"][0] == "none" and kv["dense"][2] == "none"
    assert kv["naive"] == ("rkv", 8, "none") and kv["sparse_rl"] == ("rkv", 8, "sparse_rl")
    assert kv["sparse_rl_snapkv"] == ("snapkv", 8, "sparse_rl")
    assert kv["naive_B4"] == ("rkv", 4, "none") and kv["sparse_rl_B4"] == ("rkv", 4, "sparse_rl")
    for name, c in cfgs.items():
        assert (c.seed, c.model_path, c.warm_start) == (3, str(tmp_path / "warm"), {})
        assert c.run_dir == str(tmp_path / "seed_3" / name)
        assert c.eval.compression.describe() == "rkv B=8 alpha=2 W=4 scope=response"


@pytest.mark.parametrize("old, new", [("issue20", "cpu_claims"), ("issue27", "adaptive_claims"),
                                      ("issue39", "lagchain_claims")])
def test_a_saved_config_naming_a_design_by_its_issue_reads_as_the_designs_name(old, new, tmp_path):
    cfg = load_config(ExperimentConfig, RECIPE, [f"experiment.analysis={old}"])
    assert cfg.experiment.analysis == new
    with pytest.raises(ConfigError, match=r"experiment\.analysis.*valid names: adaptive_claims, cpu_claims"):
        load_config(ExperimentConfig, RECIPE, ["experiment.analysis=issue40"])


@pytest.mark.parametrize("override, field", [
    ("experiment.arms=[dense, sparse]", "experiment.arms"),
    ("experiment.arms=[sft, sparse_rl]", "reference_arm"),
    ("experiment.budgets=[0]", "experiment.budgets"),
    ("train.model_path=/models/m", "train.model_path"),
    ("experiment.control.options={steps: 3}", "control.steps"),
])
def test_bad_experiment_choices_name_their_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(ExperimentConfig, RECIPE, [override])


def test_the_control_gets_the_reference_arms_cpu_time_in_warm_start_steps(tmp_path):
    cfg = load_config(ExperimentConfig, RECIPE, [f"experiment.out={tmp_path}"])
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "warm_start.json").write_text(json.dumps({"sft/cpu_seconds": 60.0, "sft/steps": 300.0}))
    ref = tmp_path / "seed_0" / "sparse_rl"
    with pytest.raises(RuntimeError, match="reference arm 'sparse_rl' of seed 0 is not complete"):
        control_steps(cfg, 0, warm)
    ref.mkdir(parents=True)
    (ref / ARM_DONE).write_text(json.dumps({"train_cpu_seconds": 123.0}))
    assert control_steps(cfg, 0, warm) == (615, 123.0)  # 123 s / 0.2 s per step
    fixed = load_config(ExperimentConfig, RECIPE, [f"experiment.out={tmp_path}", "experiment.control.steps=7"])
    assert control_steps(fixed, 0, warm) == (7, None)


def test_summary_statistics_are_exact():
    assert mean_spread([0.5, None, 0.7]) == (pytest.approx(0.6), pytest.approx(0.1414213562))
    assert mean_spread([0.5]) == (0.5, None) and mean_spread([None]) == (None, None)
    records = [{"step": 0, "eval/dense/accuracy": 0.5, "eval/sparse/accuracy": 0.4},
               {"step": 1, "rollout/kv_retained_frac": 0.2, "sparse/rho_min": 0.1, "train/grad_norm_max": 2.0},
               {"step": 2, "rollout/kv_retained_frac": 0.4, "sparse/rho_min": 0.0, "train/grad_norm_max": 3.0,
                "eval/dense/accuracy": 0.6, "eval/sparse/accuracy": 0.55}]
    row = seed_summary(records, {"cpu_seconds": 9.0})
    accs = (row["dense_acc_start"], row["dense_acc"], row["sparse_acc_start"], row["sparse_acc"])
    assert accs == (0.5, 0.6, 0.4, 0.55)
    rest = (row["kv_ratio"], row["rho_min"], row["grad_norm_max"], row["cpu_seconds"])
    assert rest == (pytest.approx(0.3), 0.0, 3.0, 9.0)
    assert row["clip_frac"] is None
    assert row["dense_free"] is None and row["sparse_free_start"] is None  # a task without the flag
    records[0]["eval/dense/shortcut_free_accuracy"], records[2]["eval/dense/shortcut_free_accuracy"] = 0.2, 0.7
    row = seed_summary(records, {})
    assert (row["dense_free_start"], row["dense_free"], row["sparse_free"]) == (0.2, 0.7, None)
    from sparse_rl_megatron.experiment.results import markdown_table

    table = markdown_table({"arms": {"dense": {"seeds": {0: row}, "mean": row, "std": {k: None for k in row}}}})
    assert "| shortcut-free dense start → final (%) |" in table and "| 20.0 → 70.0 | - → - |" in table


def test_the_sweep_table_puts_the_main_arms_at_the_recipes_budget(tmp_path):
    from sparse_rl_megatron.experiment.results import sweep_table

    cfg = load_config(ExperimentConfig, RECIPE, ["experiment.budgets=[4]"])
    row = {"dense_acc": 0.5, "sparse_acc": 0.25, "rejected_seq_frac": 0.07}
    summary = {"arms": {"naive": {"mean": row, "std": {}}, "sparse_rl_B4": {"mean": row, "std": {"dense_acc": 0.1}}}}
    lines = sweep_table(cfg, summary).splitlines()
    assert lines[0] == ("| budget | naive dense | naive sparse | naive rejected seqs | sparse_rl dense | "
                        "sparse_rl sparse | sparse_rl rejected seqs |")
    assert lines[2] == "| 4 | - | - | - | 50.0 ± 10.0 | 25.0 | 0.070 |"
    assert lines[3] == "| 8 | 50.0 | 25.0 | 0.070 | - | - | - |"


def test_overrides_after_a_list_option_are_split_off_and_integers_are_checked():
    import argparse

    from sparse_rl_megatron.experiment.cli import add_arguments, split_lists
    from sparse_rl_megatron.utils.errors import UsageError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", "x.yaml", "--seeds", "0", "1", "--arms", "dense", "sft", "train.steps=3"])
    assert split_lists(args) == ({"seeds": [0, 1], "arms": ["dense", "sft"]}, ["train.steps=3"])
    with pytest.raises(UsageError, match="--budgets takes integers, got four"):
        split_lists(parser.parse_args(["--config", "x.yaml", "--budgets", "four"]))


def test_the_budget_rule_picks_the_smallest_passing_budget_and_half_of_it_as_the_dose():
    from sparse_rl_megatron.experiment.budget_rule import choose_budgets, study_caches
    from sparse_rl_megatron.experiment.config import BudgetRuleConfig

    def seed(veto6, veto8, r6=0.3, r8=0.3):
        return {"dense": {"veto": 0.0, "reward": 0.3}, "rkv B=6": {"veto": veto6, "reward": r6},
                "rkv B=8": {"veto": veto8, "reward": r8}, "rkv B=12": {"veto": 0.05, "reward": 0.3}}

    rule = BudgetRuleConfig(candidates=[6, 8, 12])
    # pooled veto at 6: (0.1 + 0.4) / 2 = 0.25 > 0.2 -> 8 (0.15 <= 0.2, ratio 1.0); B_h = max(3, 8 // 2) = 4
    choice = choose_budgets({0: seed(0.1, 0.1), 1: seed(0.4, 0.2)}, "rkv", rule)
    assert (choice["budget"], choice["harsh_budget"], choice["fallback_to_largest"]) == (8, 4, False)
    assert [r["passes"] for r in choice["table"]] == [False, True, True]
    # the reward ratio binds too: 6 has a low veto but (0.2 + 0.2) / 2 / 0.3 = 0.67 < 0.8
    assert choose_budgets({0: seed(0.0, 0.0, r6=0.2), 1: seed(0.0, 0.0, r6=0.2)}, "rkv", rule)["budget"] == 8
    # nothing passes: the largest candidate
    bad = {0: {**seed(0.5, 0.5), "rkv B=12": {"veto": 0.5, "reward": 0.3}}}
    assert choose_budgets(bad, "rkv", rule)["budget"] == 12 and choose_budgets(bad, "rkv", rule)["fallback_to_largest"]
    caches = [c.describe() for c in study_caches(load_config(ExperimentConfig, RECIPE).train.rollout.compression, 8, 4)]
    assert caches == ["rkv B=16 alpha=2 W=4 scope=response", "rkv B=4 alpha=2 W=4 scope=response",
                      "snapkv B=8 alpha=2 W=4 scope=response", "streamingllm B=8 alpha=2 W=4 scope=response"]
