"""``sparse-rl plan``'s per-GPU ledger of a step's phases (``planning/phases.py``), the learner's resident bytes per
offload mode (``planning/residency.py``), and planning the shipped recipes (``--config``, ``planning/recipe.py``)."""
import dataclasses
from pathlib import Path

import pytest

from sparse_rl_megatron.cli import main
from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.learner.offload import OFFLOAD_MODES
from sparse_rl_megatron.models.arch import arch_from_hf_config
from sparse_rl_megatron.models.catalog import hf_config
from sparse_rl_megatron.planning.inputs import GIB, BatchShape, Layout, LearnerSetting, RolloutSetting
from sparse_rl_megatron.planning.plan import build_plan
from sparse_rl_megatron.planning.recipe import bundled_name_of
from sparse_rl_megatron.planning.residency import learner_resident_bytes

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs" / "recipes").glob("qwen*/*.yaml"))
N_7B_TP4 = 1_904_057_344  # Qwen2.5-7B's parameters on one GPU at TP4 (tests/unit/test_plan.py, by hand)
N_7B = 7_615_616_512  # all of Qwen2.5-7B's parameters (the engine's weights)
PLUGIN_7B_TP4 = 4097 * 32_772 * 4 + 28 * 4097 * 7 * 8 * 128 * 2  # the sparse_kv plugin at rollout TP4, 4097 rows


def _plan_7b(offload: str, **rollout):
    arch = arch_from_hf_config(hf_config("qwen2.5-7b"))
    learner = LearnerSetting(reference_model=True, offload=offload)
    return build_plan("qwen2.5-7b", arch, Layout(4, 1, 2), BatchShape(32, 8, 512, 4096), learner,
                      RolloutSetting(tp=4, **rollout), CompressionConfig(method="rkv", budget=512, buffer=128))


def test_ledger_by_hand_offload_optimizer_with_a_reference():
    """Qwen2.5-7B at TP4 x DP2 (n parameters per GPU), a KL reference, ``--offload optimizer``, rkv B=512 W=128."""
    n = N_7B_TP4
    p = _plan_7b("optimizer")
    led = p.ledger
    rollout, recompute, train, sync = led.phases
    # asleep: weights 2n and gradients 4n stay, the optimizer's 6n shards sleep; the reference's 2n stays
    assert p.resident == 8 * n
    engine_weights = 2 * N_7B / 4
    pool = 0.85 * (80 * GIB - 8 * n) - engine_weights - PLUGIN_7B_TP4
    assert rollout.items == {"learner weights": 2 * n, "learner gradients, fp32": 4 * n, "learner optimizer state": 0,
                             "KL reference policy weights": 2 * n, "engine weights, bf16": engine_weights,
                             "engine KV pool": pool, "sparse_kv plugin tables": PLUGIN_7B_TP4}
    assert led.engine.free == 80 * GIB - 8 * n and led.engine.headroom == pytest.approx(0.15 * (80 * GIB - 8 * n))
    # each phase holds what its turn keeps awake (learner/turns.py): the recompute the weights (the optimizer's
    # shards stay asleep, the gradients were never put to sleep) and the reference; the train turn the whole
    # learner (the reference sleeps, but offload=optimizer keeps weights awake); the memory saver frees the engine
    awake = {"learner weights": 2 * n, "learner gradients, fp32": 4 * n, "learner optimizer state": 6 * n}
    reference = {"KL reference policy weights": 2 * n}
    # forward-only log-probs of a 3 x 4607-token micro-batch: the layer input (bf16 h x T), one layer's
    # activations (61,220 bytes per token, tests/unit/test_plan.py), the LM-head chunk (512 x 38,016 x (fp32 +
    # bf16)), and the step's [256, 4096] fp32 log-probs
    temporaries = 2 * 3584 * 13_821 + 61_220 * 13_821 + 512 * 38_016 * 6 + 4 * 256 * 4096
    assert recompute.items == {**awake, "learner optimizer state": 0, **reference,
                               "log-prob recompute temporaries": temporaries}
    assert train.total == p.stages[0].total(p.learner) and set(awake.items()) <= set(train.items.items())
    # sync: the learner's weights (+ the gradients offload=optimizer keeps), the reference's (kept likewise), the
    # engine's weights, one bucket: the 152,064 x 3584 bf16 embedding (> 512 MiB)
    assert sync.items == {**awake, "learner optimizer state": 0, **reference, "engine weights, bf16": engine_weights,
                          "weight-sync bucket": 2 * 152_064 * 3584}
    assert led.fits and led.problem() is None


def test_without_the_memory_saver_the_released_engine_keeps_its_weights_and_pool():
    p = _plan_7b("all", memory_saver=False)
    rollout, recompute, train, sync = p.ledger.phases
    kept = {k: rollout.items[k] for k in ("engine weights, bf16", "engine KV pool", "sparse_kv plugin tables")}
    assert p.resident == 0 and kept["engine KV pool"] == 0.85 * 80 * GIB - 2 * N_7B / 4 - PLUGIN_7B_TP4
    for phase in (recompute, train, sync):
        assert {k: phase.items[k] for k in kept} == kept
    assert train.total == p.stages[0].total(p.learner) + sum(kept.values())  # the reference asleep, as the total says
    assert p.stages[0].total(p.learner) == p.stages[0].total(dataclasses.replace(p.learner, offload="none")) - 2 * N_7B_TP4
    assert not p.ledger.fits and [ph.name for ph in p.ledger.over] == ["train"]  # weights alone fit beside it


@pytest.mark.parametrize("mode", OFFLOAD_MODES.names())
def test_learner_resident_bytes_per_part(mode):
    """What stays per part while asleep: 0 for the mode's sleeping parts, the learner table's figure for the rest
    (bf16: 2 / 4 / 6 bytes per parameter at DP 2 with the distributed optimizer); awake: every part."""
    n = N_7B_TP4
    arch = arch_from_hf_config(hf_config("qwen2.5-7b"))
    setting = LearnerSetting(offload=mode)
    awake = {"weights": 2 * n, "gradients": 4 * n, "optimizer": 6 * n}
    asleep = learner_resident_bytes(arch, Layout(4, 1, 2), setting)
    assert asleep == {part: 0 if part in OFFLOAD_MODES.get(mode).parts else b for part, b in awake.items()}
    assert learner_resident_bytes(arch, Layout(4, 1, 2), setting, asleep=False) == awake
    fp32 = learner_resident_bytes(arch, Layout(4, 1, 1), LearnerSetting(params_dtype="float32", offload=mode,
                                                                          distributed_optimizer=False), asleep=False)
    assert fp32 == {"weights": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}  # fp32: Adam's moments only


def test_a_rollout_phase_that_does_not_fit_fails_naming_the_phase_and_the_nearest_fit(capsys):
    """Qwen3-30B-A3B on 8 GPUs with nothing asleep: the learner keeps 71.5 GiB + the reference 9.6 GiB, so SGLang's
    pool from the 8.5 GiB left is negative."""
    argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--ep", "8", "--etp", "1", "--prompts", "128",
            "--samples", "8", "--max-tokens-per-device", "8192", "--recompute", "full", "--rollout-tp", "2",
            "--mem-fraction", "0.7", "--compression", "rkv", "--max-running-requests", "1024", "--kl-reference"]
    assert main([*argv, "--offload", "none"]) == 1
    out = capsys.readouterr().out
    assert "\nphase rollout DOES NOT FIT: the KV pool (-30.89 GiB per GPU) cannot hold one sequence (30.0 MiB); " \
           "SGLang refuses to start\n" in out
    assert "\nnearest offload setting or layout that fits: " in out


def test_the_nearest_fit_can_be_an_offload_mode(capsys):
    """Qwen2.5-7B at TP2 x DP4 with a reference, 32k responses, SGLang at mem fraction 0.38: awake the learner
    keeps 7.09 + 14.19 + 10.64 + 7.09 GiB, so the pool (0.38 x 41 GiB - 14.19) holds not one 1.78 GiB sequence;
    with the optimizer asleep it does, on the same layout."""
    argv = ["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--tp", "2", "--rollout-tp", "1", "--kl-reference",
            "--recompute", "full", "--response-len", "32768", "--mem-fraction", "0.38", "--prompts", "128",
            "--samples", "8"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "phase rollout DOES NOT FIT: the KV pool (1.39 GiB per GPU) cannot hold one sequence (1,819.9 MiB)" in out
    assert "nearest offload setting or layout that fits: TP2 x PP1 x DP4 = 8 GPUs of 80 GiB, --offload optimizer" in out
    assert main([*argv, "--offload", "optimizer"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_recipe_fits_every_phase(capsys, recipe):
    """``sparse-rl plan --config`` of each shipped GPU recipe: every phase fits 80 GiB GPUs (exit 0)."""
    code = main(["plan", "--config", str(recipe)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "every phase fits 80 GiB per GPU" in out


def test_recipe_model_names_and_options_with_config(capsys):
    assert bundled_name_of("/models/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert bundled_name_of("/models/Qwen2.5-72B-Instruct/") == "qwen2.5-72b"
    assert bundled_name_of("/models/Qwen3-30B-A3B") == "qwen3-30b-a3b"
    with pytest.raises(ValueError, match=r"^the recipe's model_path '/m/Llama-3-8B' names no bundled config \(valid "
                                         r"names: qwen2.5-1.5b, .*\); give --model NAME or an HF checkpoint directory$"):
        bundled_name_of("/m/Llama-3-8B")
    recipe = str(ROOT / "configs" / "recipes" / "qwen2.5-7b" / "rkv.yaml")
    assert main(["plan", "--config", recipe, "--tp", "4"]) == 2
    assert "--tp is the recipe's with --config; change the recipe's value with a key=value override" in \
        capsys.readouterr().err
    assert main(["plan", "--config", recipe, "learner.offload=sideways"]) == 2
    assert "unknown learner offload mode 'sideways'; valid names: all, none, optimizer" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2.5-7b", "--offload", "sideways"]) == 2
    assert "--offload: unknown learner offload mode 'sideways'; valid names: all, none, optimizer" in \
        capsys.readouterr().err
    # the recipe's settings reach the plan: TP2 x DP4, 128 x 8 rollouts, mem fraction 0.7, a reference (KL 1e-4)
    assert main(["plan", "--config", recipe, "learner.offload=all"]) == 0
    out = capsys.readouterr().out
    assert "on TP2 x PP1 x DP4 = 8 GPUs of 80 GiB" in out and "128 prompts x 8 samples = 1024 rollouts" in out
    assert "| KL reference policy weights | 0.00 | 7.09 | 0.00 | 0.00 |" in out  # awake for the recompute only
    assert "(0.7 x (GPU - 0.00 GiB the sleeping learner keeps)" in out
