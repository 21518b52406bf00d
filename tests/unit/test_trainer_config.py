"""``sparse-rl train`` configs: every recipe loads, the learner section is typed, bad values name their field,
and preflight catches bad files and layouts before any model loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.trainer.run_plan import preflight
from sparse_rl_megatron.utils.config_io import ConfigError, from_dict, load_config
from sparse_rl_megatron.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
# experiments/ holds `sparse-rl experiment` recipes (tests/unit/test_experiment_config.py loads them)
RECIPES = sorted(p for p in (ROOT / "configs").rglob("*.yaml")
                 if not {"base", "experiments"} & set(p.relative_to(ROOT / "configs").parts))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_recipe_loads_into_train_config(recipe):
    cfg = load_config(TrainConfig, recipe)
    assert cfg.learner_config("x").model_path == "x"


def test_learner_section_is_typed_and_checked():
    cfg = from_dict(TrainConfig, {"learner": {"tensor_parallel_size": 2, "optim": {"lr": 1e-5},
                                              "megatron_overrides": {"recompute_granularity": "full"}}})
    lc = cfg.learner_config("/models/m")
    assert (lc.model_path, lc.tensor_parallel_size, lc.optim.lr) == ("/models/m", 2, 1e-5)
    assert lc.megatron_overrides == {"recompute_granularity": "full"}
    with pytest.raises(ConfigError, match=r"^learner: unknown key\(s\) tp; valid keys: batch_layout, .*tensor_parallel_size"):
        from_dict(TrainConfig, {"learner": {"tp": 2}})
    with pytest.raises(ConfigError, match=r"^learner: unknown key\(s\) model_path"):  # the run's, not the learner's
        from_dict(TrainConfig, {"learner": {"model_path": "x"}})
    with pytest.raises(ConfigError, match=r"learner.optim: OptimConfig.lr_decay_style must be one of constant"):
        from_dict(TrainConfig, {"learner": {"optim": {"lr_decay_style": "wavy"}}})
    with pytest.raises(ConfigError, match=r"learner: LearnerConfig.batch_layout: unknown batch layout 'x'; valid names: packed, padded"):
        from_dict(TrainConfig, {"learner": {"batch_layout": "x"}})


def test_lr_decay_shorter_than_the_run_is_refused_unless_asked():
    base = {"steps": 15, "global_batch_size": 32, "rollout": {"prompts_per_step": 16, "samples_per_prompt": 8},
            "learner": {"optim": {"lr_decay_style": "cosine", "lr_decay_steps": 60}}}
    assert from_dict(TrainConfig, base).learner_config("m").optim.lr_decay_steps == 60  # 15 x 4: exactly the run
    with pytest.raises(ConfigError, match=r"^learner.optim.lr_decay_steps=60 ends the cosine decay before the run's "
                                          r"600 optimizer steps .*min_lr=0.0 from step 61.*lr_decay_steps: null"):
        from_dict(TrainConfig, {**base, "steps": 150})
    ok = from_dict(TrainConfig, {**base, "steps": 150, "learner": {"optim": {
        "lr_decay_style": "cosine", "lr_decay_steps": 60, "allow_short_decay": True}}})
    assert ok.learner_config("m").optim.lr_decay_steps == 60
    # constant schedules never reach min_lr early; None follows the run's length (a steps= override stretches it)
    const = from_dict(TrainConfig, {**base, "steps": 150, "learner": {"optim": {"lr_decay_steps": 60}}})
    assert const.learner_config("m").optim.lr_decay_steps == 60
    rel = from_dict(TrainConfig, {**base, "steps": 150, "learner": {"optim": {
        "lr_decay_style": "cosine", "lr_decay_steps": None, "lr_warmup_steps": 10}}})
    assert rel.learner_config("m").optim.lr_decay_steps == 600 and rel.learner.optim.lr_decay_steps is None
    from sparse_rl_megatron.learner.config import OptimConfig

    assert OptimConfig(lr_decay_steps=None, lr_warmup_steps=5).for_run(3).lr_decay_steps == 6  # past the warm-up


def test_engine_placement_is_the_rollout_sections_and_the_layouts():
    cfg = from_dict(TrainConfig, {"rollout": {"engine": "sglang", "gpus_per_engine": 2,
                                              "sglang": {"urls": ["http://a:1", "http://b:2"],
                                                         "weight_sync": "distributed"}}})
    sg = cfg.rollout.sglang_config("/m", base_gpu_id=4, urls=["http://b:2"])
    assert (sg.tp_size, sg.base_gpu_id, sg.urls, sg.master_address) == (2, 4, ["http://b:2"], "")
    assert cfg.rollout.sglang_config("/m").urls == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match=r"^rollout: RolloutConfig.gpus_per_engine must be >= 1, got 0$"):
        from_dict(TrainConfig, {"rollout": {"gpus_per_engine": 0}})
    with pytest.raises(ConfigError, match=r"^rollout.sglang: unknown key\(s\) tp_size"):  # it is gpus_per_engine
        from_dict(TrainConfig, {"rollout": {"engine": "sglang", "sglang": {"tp_size": 2}}})


def test_one_sample_per_prompt_needs_an_estimator_that_works_with_one():
    with pytest.raises(ConfigError, match=r"samples_per_prompt=1 with correction.advantage_estimator='grpo' trains on "
                                          r"zero advantages.*: reinforce"):
        from_dict(TrainConfig, {"rollout": {"samples_per_prompt": 1}})
    cfg = from_dict(TrainConfig, {"rollout": {"samples_per_prompt": 1},
                                  "correction": {"advantage_estimator": "reinforce"}})
    assert cfg.rollout.batch_size == cfg.rollout.prompts_per_step


def test_global_batch_must_divide_the_rollout_batch():
    cfg = from_dict(TrainConfig, {"rollout": {"prompts_per_step": 4, "samples_per_prompt": 4}, "global_batch_size": 8})
    assert cfg.optimizer_steps_per_rollout == 2
    with pytest.raises(ConfigError, match=r"global_batch_size=6 must divide the rollout batch .* = 16"):
        from_dict(TrainConfig, {"rollout": {"prompts_per_step": 4, "samples_per_prompt": 4}, "global_batch_size": 6})
    with pytest.raises(ConfigError, match=r"^eval: TrainEvalConfig.modes must be a non-empty list of dense, sparse"):
        from_dict(TrainConfig, {"eval": {"modes": ["fast"]}})


# ------------------------------------------------------------------------------------------------- preflight
def _model_dir(path: Path, **overrides) -> Path:
    """A model directory that passes the file checks (config + an empty weights file; nothing loads it)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256, **overrides}
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    return path


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, **fields) -> TrainConfig:
    data = {"model_path": str(_model_dir(tmp_path / "m")), "run_dir": str(tmp_path / "run"),
            "data": {"dataset": str(_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2"}]))}}
    for key, value in fields.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return from_dict(TrainConfig, data)


def test_preflight_passes_and_resolves_defaults(tmp_path):
    plan = preflight(_cfg(tmp_path), world_size=2)
    assert (plan.template, plan.reward, len(plan.train_data), plan.eval_data) == ("qwen25_chat", "math", 1, {})
    assert plan.hf_config["num_attention_heads"] == 4
    # one engine per rank by default, on every node (two nodes of one rank here)
    plan = preflight(_cfg(tmp_path), world_size=2, ranks_per_node=1, on_gpu=False)
    assert plan.layout.describe() == "rollout: 2 hf engines on ranks 0-1 (CPU), 4 groups -> 2 per engine"
    assert [s.node for s in plan.layout.slots] == [0, 1]


@pytest.mark.parametrize("fields,world,message", [
    ({"model_path": "/no/such/model"}, 1, r"^model_path: /no/such/model does not exist$"),
    ({"learner.tensor_parallel_size": 2}, 3, r"^learner.tensor_parallel_size x learner.pipeline_parallel_size = 2 x 1 "
                                             r"= 2 does not divide the world size 3"),
    ({"learner.tensor_parallel_size": 4}, 4, r"^learner: tensor_parallel_size=4 does not divide num_query_groups .*=2 .*\(model .*/m\)$"),
    ({"learner.pipeline_parallel_size": 3}, 3, r"^learner: pipeline_parallel_size=3 does not divide .*"),
    ({"data.template": "chatml"}, 1, r"^data.template: unknown prompt template 'chatml'; valid names: plain, "),
    ({"reward.name": "bleu"}, 1, r"^reward.name: unknown reward 'bleu'; valid names: exact, math"),
    ({"rollout.engine": "vllm"}, 1, r"^rollout.engine: unknown rollout engine 'vllm'; valid names: hf, sglang$"),
    ({"data.dataset": "gsm9k"}, 1, r"^data.dataset: 'gsm9k' is neither a named data set \(valid names: aime24, "),
    ({"data.dataset": "gsm8k_train", "data.data_root": "/no/root"}, 1,
     r"^data.dataset: data set 'gsm8k_train' expects /no/root/train/gsm8k/train.jsonl.* with data.data_root or "),
    ({"data.dataset": "/no/file.jsonl"}, 1, r"^data.dataset: data file not found: /no/file.jsonl$"),
    ({"eval.datasets": ["gsm8k", "/no/eval.jsonl"]}, 1, r"^eval.datasets: "),
    ({"model_path": "task:nope"}, 1, r"^model_path: unknown task 'nope'; valid names:"),
    ({"warm_start": {"steps": 3}}, 1, r"^warm_start: options are only used with model_path: task:<name>"),
    ({"checkpoint.resume": "/no/ckpt"}, 1, r"^checkpoint.resume: /no/ckpt does not exist \(valid: auto, never, or"),
    ({"rollout.gpus_per_engine": 4}, 2, r"^rollout.gpus_per_engine=4 must divide the 2 rank\(s\) per node \(an "
                                        r"engine's GPUs are on one node\); valid: 1, 2$"),
])
def test_preflight_errors_name_the_field(tmp_path, fields, world, message):
    with pytest.raises(UserError, match=message):
        preflight(_cfg(tmp_path, **fields), world_size=world)


def test_preflight_names_bad_files(tmp_path):
    cfg = _cfg(tmp_path)
    (Path(cfg.model_path) / "config.json").write_text('{"model_type": "qwen2",')
    with pytest.raises(UserError, match=r"^.*/m/config.json is not valid JSON"):
        preflight(cfg, 1)
    _model_dir(Path(cfg.model_path), model_type="gpt9")
    with pytest.raises(UserError, match=r"^learner: unknown model family 'gpt9'|model_type"):
        preflight(cfg, 1)
    cfg = _cfg(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    cfg.data.dataset = str(tmp_path / "empty.jsonl")
    with pytest.raises(UserError, match=r"^data.dataset: data file .*empty.jsonl has no usable rows"):
        preflight(cfg, 1)
    cfg.data.dataset = str(_jsonl(tmp_path / "nolabel.jsonl", [{"prompt": "1+1?"}, {"prompt": "2+2?"}]))
    with pytest.raises(UserError, match=r"^data.dataset: data file .*nolabel.jsonl has no usable rows \(2 malformed.*"
                                        r"line 1: .*answer"):
        preflight(cfg, 1)


def test_paper_recipes_carry_the_reference_settings_and_a_consistent_layout():
    from sparse_rl_megatron.trainer.launch_preflight import LaunchShape, check_gpus
    from sparse_rl_megatron.trainer.run_plan import check_launch_layout, rollout_layout

    recipes = {p.parent.name + "/" + p.stem: load_config(TrainConfig, p) for p in RECIPES
               if "recipes" in p.parts and p.parent.name.startswith("qwen2.5")}
    assert len(recipes) == 12  # Qwen2.5 1.5B / 3B / 7B x dense, rkv, snapkv, naive
    for name, cfg in recipes.items():
        assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.global_batch_size) == (128, 8, 256)
        assert cfg.optimizer_steps_per_rollout == 4 and cfg.rollout.sampling.max_new_tokens == 4096
        assert (cfg.learner.optim.lr, cfg.learner.loss.kl_coef, cfg.data.dataset) == (1e-6, 1e-4, "math_train_l3to5")
        assert cfg.rollout.engine == "sglang" and cfg.launch.gpus and cfg.launch.layout
        method = name.split("/")[1]
        assert cfg.rollout.compression.method == {"dense": "none", "snapkv": "snapkv"}.get(method, "rkv"), name
        assert cfg.correction.mode == ("none" if method == "naive" else "sparse_rl"), name
        if method != "dense":
            c = cfg.rollout.compression
            assert (c.budget, c.window, c.buffer) == (512, 8, 128)
        gpus = cfg.launch.gpus
        check_gpus(LaunchShape(1, gpus), visible=gpus, tp=cfg.learner.tensor_parallel_size,
                   pp=cfg.learner.pipeline_parallel_size, expected=gpus)
        # launch.layout says what starts: the line the trainer and `sparse-rl preflight` print, one engine per GPU
        starts = rollout_layout(cfg, gpus, ranks_per_node=gpus, on_gpu=True)
        assert " ".join(cfg.launch.layout.split()).endswith(starts.describe()), name
        assert starts.num_engines == gpus and starts.describe().startswith(f"rollout: {gpus} sglang engines x TP1")
        check_launch_layout(cfg, gpus, ranks_per_node=gpus)
        assert cfg.run_dir == f"runs/{name.replace('/', '-')}"
        sp = cfg.learner.megatron_overrides.get("sequence_parallel", False)
        assert sp == (cfg.learner.tensor_parallel_size > 1), name  # the reference's SP wherever TP allows it


def test_qwen3_moe_recipes_use_expert_parallelism_and_say_what_starts():
    """The Qwen3-30B-A3B recipes (one node, two nodes): the paper's settings, EP 8 inside a node, 2-GPU SGLang engines,
    a layout line that says what starts, the preflight's layout checks passing, and a plan that fits."""
    from sparse_rl_megatron.models.arch import arch_from_hf_config
    from sparse_rl_megatron.models.catalog import bundled_config
    from sparse_rl_megatron.trainer.launch_preflight import LaunchShape, check_gpus
    from sparse_rl_megatron.trainer.run_plan import check_launch_layout

    arch = arch_from_hf_config(bundled_config("qwen3-30b-a3b"))
    folder = ROOT / "configs" / "recipes" / "qwen3-30b-a3b"
    recipes = {p.stem: load_config(TrainConfig, p) for p in sorted(folder.glob("*.yaml"))}
    assert sorted(recipes) == ["dense", "naive", "rkv", "rkv-2nodes", "snapkv"]
    for name, cfg in recipes.items():
        gpus = cfg.launch.gpus
        assert gpus == (16 if name.endswith("2nodes") else 8) and cfg.run_dir == f"runs/qwen3-30b-a3b-{name}"
        assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.global_batch_size) == (128, 8, 256)
        learner = cfg.learner
        assert (learner.tensor_parallel_size, learner.expert_parallel_size, learner.expert_tensor_parallel) == (1, 8, 1)
        arch.check_expert_parallel(learner.expert_parallel_size, learner.expert_tensor_parallel)
        assert cfg.rollout.gpus_per_engine == 2 and cfg.rollout.sglang.max_running_requests == 1024
        assert learner.offload == "all"  # colocated: the learner sleeps while the engines decode (issue 50)
        check_gpus(LaunchShape(gpus // 8, 8), visible=8, tp=1, pp=1, expected=gpus)
        check_launch_layout(cfg, gpus, ranks_per_node=8)
        assert "rollout: " in cfg.launch.layout


@pytest.mark.parametrize("gpus", [8, 16])
def test_the_qwen3_moe_recipe_layouts_fit_by_the_plan(gpus):
    """``sparse-rl plan`` of the recipes' layouts (learner and 2-GPU engines at the paper's batch, a KL reference)
    fits every phase of 80 GiB GPUs with the learner asleep while the engines decode; awake beside them on one node,
    SGLang's pool has nothing left (exit 1). (tests/unit/test_plan_phases.py plans every recipe file.)"""
    from sparse_rl_megatron.planning.cli import add_arguments, run

    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "qwen3-30b-a3b", "--gpus", str(gpus), "--ep", "8", "--etp", "1",
                              "--prompts", "128", "--samples", "8", "--response-len", "4096",
                              "--max-tokens-per-device", "8192", "--recompute", "full", "--rollout-tp", "2",
                              "--mem-fraction", "0.7", "--compression", "rkv", "--budget", "512", "--buffer", "128",
                              "--max-running-requests", "1024", "--kl-reference", "--offload", "all"])
    assert run(args) == 0
    if gpus == 8:
        args.offload = "none"
        assert run(args) == 1


def test_a_recipe_layout_that_does_not_say_what_starts_is_refused():
    from sparse_rl_megatron.trainer.run_plan import check_launch_layout

    cfg = load_config(TrainConfig, ROOT / "configs" / "recipes" / "qwen2.5-7b" / "rkv.yaml", ["rollout.gpus_per_engine=2"])
    with pytest.raises(UserError, match=r"^launch.layout says 'rollout: 8 sglang engines x TP1 on ranks 0-7 \(GPUs "
                                        r"0-7\), 128 groups -> 16 per engine', but this launch of 8 GPUs starts "
                                        r"'rollout: 4 sglang engines x TP2 on ranks 0,2,4,6 \(GPUs 0-1, 2-3, 4-5, "
                                        r"6-7\), 128 groups -> 32 per engine'; correct the recipe's launch.layout$"):
        check_launch_layout(cfg, 8, ranks_per_node=8)
    check_launch_layout(cfg, 16, ranks_per_node=8)  # another size: the recipe's words do not apply


def test_a_recipe_scales_down_with_launch_gpus():
    from sparse_rl_megatron.trainer.run_plan import check_launch_layout

    recipe = ROOT / "configs" / "recipes" / "qwen2.5-1.5b" / "rkv.yaml"
    cfg = load_config(TrainConfig, recipe, ["launch.gpus=1"])  # the recipe's 4-GPU layout line no longer applies
    assert cfg.launch.gpus == 1 and cfg.launch.layout == ""
    check_launch_layout(cfg, 1, ranks_per_node=1)
    said = "rollout: 1 sglang engine x TP1 on rank 0 (GPU 0), 128 groups"
    cfg = load_config(TrainConfig, recipe, ["launch.gpus=1", f"launch.layout={said}"])  # YAML would read a mapping
    assert cfg.launch.layout == said
    assert load_config(TrainConfig, recipe).launch.layout.startswith("1 node x 4 GPUs")
    # another engine: the recipe's SGLang options are dropped (they would be refused with the hf engine)
    hf = load_config(TrainConfig, recipe, ["rollout.engine=hf"])
    assert hf.rollout.engine == "hf" and hf.rollout.sglang == TrainConfig().rollout.sglang
    assert load_config(TrainConfig, recipe, ["rollout.engine=sglang"]).rollout.sglang.memory_saver  # kept


def test_sglang_engines_sample_from_the_runs_seed_unless_told():
    cfgs = [from_dict(TrainConfig, {"seed": seed, "rollout": {"engine": "sglang"}}) for seed in (0, 7)]
    assert [c.rollout.sglang.random_seed for c in cfgs] == [None, None]  # the recipe leaves it to the run
    assert [c.rollout.for_run(c.seed).sglang_config("m").random_seed for c in cfgs] == [0, 7]
    fixed = from_dict(TrainConfig, {"seed": 7, "rollout": {"engine": "sglang", "sglang": {"random_seed": 3}}})
    assert fixed.rollout.for_run(fixed.seed).sglang_config("m").random_seed == 3
    hf = from_dict(TrainConfig, {"seed": 7})
    assert hf.rollout.for_run(hf.seed) is hf.rollout


def test_adaptive_budget_section_is_typed_and_checked():
    rkv = {"method": "rkv", "budget": 16, "window": 2, "buffer": 4}
    cfg = from_dict(TrainConfig, {"rollout": {"compression": rkv, "adaptive_budget": {
        "enabled": True, "min_budget": 8, "max_budget": 64, "signal": "veto_frac"}}})
    assert cfg.rollout.adaptive_budget.enabled and cfg.rollout.adaptive_budget.target == 0.2
    assert cfg.rollout.budget_compression(24).budget == 24 and cfg.rollout.budget_compression(None).budget == 16
    assert not from_dict(TrainConfig, {}).rollout.adaptive_budget.enabled  # off by default
    # sglang: the server is sized for max_budget (each step's requests carry their own budget)
    sg = from_dict(TrainConfig, {"rollout": {"engine": "sglang", "compression": rkv, "adaptive_budget": {
        "enabled": True, "max_budget": 64}}}).rollout
    assert sg.sglang_config("m").compression.budget == 64 and sg.compression.budget == 16
    sg.adaptive_budget.enabled = False
    assert sg.sglang_config("m").compression.budget == 16
    bad = [
        ({"enabled": True}, {"method": "none"}, "hf", r"^rollout: adaptive_budget.enabled needs a compressing"),
        ({"enabled": True, "min_budget": 4}, {"window": 4}, "hf",
         r"^rollout: adaptive_budget.min_budget \(4\) must be > compression.window \(4\)"),
        ({"enabled": True, "min_budget": 4, "max_budget": 12}, {}, "hf",
         r"^rollout: compression.budget \(16\) is the adaptive budget's start and must be within "
         r"\[adaptive_budget.min_budget, max_budget\] = \[4, 12\]"),
        ({"signal": "p1"}, {}, "hf", r"^rollout.adaptive_budget: AdaptiveBudgetConfig.signal: unknown adaptive budget "
                                     r"signal 'p1'; valid names: contaminated_frac, kl_k3, rho_p1, token_below_frac, veto_frac"),
        ({"gain": -1.0}, {}, "hf", r"^rollout.adaptive_budget: AdaptiveBudgetConfig.gain must be > 0"),
        ({"tartget": 0.1}, {}, "hf", r"^rollout.adaptive_budget: unknown key\(s\) tartget; valid keys: deadband"),
    ]
    for adaptive, compression, engine, match in bad:
        with pytest.raises(ConfigError, match=match):
            from_dict(TrainConfig, {"rollout": {"engine": engine, "compression": {**rkv, **compression},
                                                "adaptive_budget": adaptive}})


@pytest.mark.parametrize("data,message", [
    ({"rollout": {"engine": "sglang"}, "learner": {"moe": {"routing_replay": True}}},
     r"^learner.moe.routing_replay=true with rollout.engine='sglang': only the hf engine records .*valid: "
     r"rollout.engine=hf, or routing_replay=false$"),
    ({"learner": {"pipeline_parallel_size": 2, "megatron_overrides": {"recompute_granularity": "full"},
                  "moe": {"routing_replay": True}}},
     r"routing_replay=true with megatron_overrides.recompute_granularity at pipeline_parallel_size=2: .*valid: "
     r"pipeline_parallel_size=1, no recompute_granularity, or routing_replay=false$"),
])
def test_routing_replay_is_refused_where_it_cannot_hold(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(TrainConfig, data)
    from_dict(TrainConfig, {"learner": {"moe": {"routing_replay": True}}})  # the hf engine at PP 1: accepted


@pytest.mark.parametrize("rollout,message", [
    ({"compression": {"method": "rkv", "budget": 16, "scope": "response"}},
     r"rollout.partial.enabled with engine sglang needs compression.scope: all .*valid: scope all, or engine hf"),
    ({"sampling": {"stop": ["</answer>"]}},
     r"rollout.partial.enabled with engine sglang needs rollout.sampling.stop empty .*valid: no stop strings, or "
     r"engine hf"),
])
def test_partial_rollouts_on_sglang_refuse_what_a_continued_request_cannot_hold(rollout, message):
    partial = {"partial": {"enabled": True}}
    with pytest.raises(ConfigError, match=message):
        from_dict(TrainConfig, {"rollout": {"engine": "sglang", **partial, **rollout}})
    from_dict(TrainConfig, {"rollout": {"engine": "hf", **partial, **rollout}})   # the reference engine holds both
