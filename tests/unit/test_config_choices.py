"""Every choice field of the recipe configs (typed ``Literal``) refuses a name outside its choices with the
dataclass's own message, naming the field, the bad name and the valid names, whether the value comes from a recipe
or from code (the loader checks only that it is a string); a choice kept by a closed registry lists the registry's
names, and its ``Literal`` holds exactly those."""
from __future__ import annotations

import copy
import dataclasses
import typing

import pytest

from sglang_ext.config import SparseKVConfig
from sparse_rl_megatron.eval.config import EvalConfig
from sparse_rl_megatron.learner.batch import BATCH_LAYOUTS
from sparse_rl_megatron.learner.config import BatchLayoutName, ExpertKernelsName, LayerSpecName
from sparse_rl_megatron.learner.model_provider import EXPERT_KERNELS, LAYER_SPECS
from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.utils.config_io import ConfigError, from_dict

BAD = "no_such_choice"


def _literal(tp):
    if typing.get_origin(tp) is typing.Literal:
        return tp
    if typing.get_origin(tp) is list:
        return _literal(typing.get_args(tp)[0])
    return None


def _choice_fields(cls, prefix=()):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _choice_fields(tp, (*prefix, f.name))
        elif _literal(tp) is not None:
            yield (*prefix, f.name), tp


ROOTS = [(TrainConfig, {}), (EvalConfig, {"model": "m"}), (SparseKVConfig, {})]
CASES = [(cls, base, path, tp) for cls, base in ROOTS for path, tp in _choice_fields(cls)]


def test_the_recipe_configs_type_their_choices():
    names = {".".join(path) for _, _, path, _ in CASES}
    assert {"learner.params_dtype", "learner.layer_spec", "learner.batch_layout", "learner.optim.lr_decay_style",
            "rollout.dtype", "rollout.compression.scope", "rollout.compression.gqa_pooling",
            "rollout.sglang.weight_sync", "rollout.sglang.distributed_backend", "eval.modes",
            "reward.verifier.start_method", "dtype", "inner_backend"} <= names, names


@pytest.mark.parametrize("cls, base, path, tp", CASES, ids=[f"{c.__name__}.{'.'.join(p)}" for c, _, p, _ in CASES])
def test_a_name_outside_the_choices_is_refused_naming_the_field(cls, base, path, tp):
    data = copy.deepcopy(base)
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = [BAD] if typing.get_origin(tp) is list else BAD
    with pytest.raises(ConfigError) as caught:
        from_dict(cls, data)
    message = str(caught.value)
    assert path[-1] in message and BAD in message, message
    assert all(name in message for name in typing.get_args(_literal(tp)) if name), message


def test_a_choice_that_is_not_a_string_is_a_type_error_as_before():
    with pytest.raises(ConfigError, match=r"^learner.params_dtype: expected str, got 16$"):
        from_dict(TrainConfig, {"learner": {"params_dtype": 16}})


def test_closed_registries_and_their_literal_agree():
    assert sorted(typing.get_args(LayerSpecName)) == LAYER_SPECS.names()
    assert sorted(typing.get_args(BatchLayoutName)) == BATCH_LAYOUTS.names()
    assert sorted(typing.get_args(ExpertKernelsName)) == EXPERT_KERNELS.names()
