"""The Megatron knobs of every recipe are fields megatron-core's TransformerConfig knows (checked against the
installed version, without building a model)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.utils.config_io import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs" / "recipes").glob("qwen*/*.yaml")),
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recipe_megatron_overrides_are_transformer_config_fields(recipe):
    from megatron.core.transformer.transformer_config import TransformerConfig

    overrides = load_config(TrainConfig, recipe).learner.megatron_overrides
    assert overrides and set(overrides) <= {f.name for f in dataclasses.fields(TransformerConfig)}
