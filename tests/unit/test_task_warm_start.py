"""The supervised stage (tasks/sft.py) and modchain's warm start built on it."""
import math

import pytest
import torch

from sparse_rl_megatron.tasks.modchain import ModChainModel, ModChainSpec, ModChainTask
from sparse_rl_megatron.tasks.sft import SFTConfig, collate
from sparse_rl_megatron.utils.config_io import ConfigError

TINY = ModChainSpec(steps=6, heldout_size=40, heldout_variants=1, train_variants=2,
                    model=ModChainModel(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64))


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    return ModChainTask(TINY).build_model(tmp_path_factory.mktemp("warm") / "init", seed=0)


def test_lr_schedule_constant_then_cosine_over_the_last_fraction():
    cfg = SFTConfig(steps=10, lr=1.0, min_lr=0.0, decay_fraction=0.4)
    lrs = [cfg.lr_at(s) for s in range(10)]
    assert lrs[:6] == [1.0] * 6
    assert lrs[6] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[9] == pytest.approx(0.0)
    assert SFTConfig(steps=10, lr=0.5, decay_fraction=0.0).lr_at(9) == 0.5


def test_collate_masks_prompts_and_padding():
    ids, labels = collate([([5, 6], [7, 8, 1]), ([5], [9, 1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 1], [5, 9, 1, 0, 0]]
    assert labels.tolist() == [[-100, -100, 7, 8, 1], [-100, 9, 1, -100, -100]]


def test_short_warm_start_lowers_the_loss_deterministically(init_dir, tmp_path):
    task = ModChainTask(TINY)
    opts = dict(steps=30, lr=1e-2, batch_size=8, log_every=0, eval_problems=0)
    m1 = task.warm_start(init_dir, tmp_path / "a", seed=1, **opts)
    assert m1["sft/steps"] == 30 and m1["sft/seconds"] > 0 and m1["sft/cpu_seconds"] > 0
    assert m1["sft/loss_last"] < 0.7 * m1["sft/loss_first"], m1
    task.warm_start(init_dir, tmp_path / "b", seed=1, **opts)
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "tokenizer.json").is_file() and not (tmp_path / "a.partial").exists()
    # continuing from the result (the equal-time supervised control) works from any checkpoint of the task
    m2 = task.warm_start(tmp_path / "a", tmp_path / "c", seed=2, steps=5, lr=1e-3, batch_size=8, log_every=0,
                         eval_problems=4)
    assert m2["sft/loss_first"] < m1["sft/loss_first"] and 0.0 <= m2["sft/heldout_acc"] <= 1.0


def test_bad_options_and_existing_output_are_refused_before_training(init_dir, tmp_path):
    task = ModChainTask(TINY)
    with pytest.raises(ConfigError, match="warm_start: unknown key\\(s\\) stepz; valid keys: .*steps"):
        task.warm_start(init_dir, tmp_path / "x", stepz=3)
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        task.warm_start(init_dir, tmp_path / "x", steps=0)
    (tmp_path / "x").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        task.warm_start(init_dir, tmp_path / "x", steps=1)
