"""One ``FamilySpec`` per model family (``sparse_rl_megatron/models/families/``), registered once, and every other
list of model types read from it: no tuple, list, set or dict of model-type literals, and no comparison with one,
outside the family modules (an AST scan of the library and the SGLang plugin); every registered family round-trips
from its tiny builder through ``ModelArch`` to the weight map (the tensors its features name, bit-identical both
ways); and what reads the registry (the HF engine, the tiny ``model_path`` values, SGLang's tied-head refusal) sees
each family's facts."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import sglang_ext
import sparse_rl_megatron
from sglang_ext.refusals import tied_moe_head
from sparse_rl_megatron.models import weight_map as W
from sparse_rl_megatron.models.arch import arch_from_hf_config, read_hf_config
from sparse_rl_megatron.models.families import (
    FAMILY_SPECS,
    FEATURES,
    FamilySpec,
    families,
    family_names,
    family_spec,
    register_family,
)
from sparse_rl_megatron.models.tiny import build_tiny_model, tiny_config
from sparse_rl_megatron.trainer.config import TINY_MODEL, TINY_MODELS
from sparse_rl_megatron.utils.registry import UnknownNameError

LIBRARY = Path(sparse_rl_megatron.__file__).parent
PLUGIN = Path(sglang_ext.__file__).parent
FAMILY_DIR = LIBRARY / "models" / "families"


def _literal_lists(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """``(line, source)`` of every tuple / list / set / dict display holding a string literal in ``names``, and of
    every comparison with one (an ``if family == "qwen2"`` chain is a list spelled out too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None] + node.values
        elif isinstance(node, ast.Compare):
            items = [node.left, *node.comparators]
        else:
            continue
        if any(isinstance(i, ast.Constant) and i.value in names for i in items):
            found.append((node.lineno, ast.unparse(node)))
    return found


def model_type_lists(roots: tuple[Path, ...], names: set[str], skip: Path) -> list[str]:
    """``path:line: source`` of each list of (or comparison with) model-type literals under ``roots``, outside
    ``skip``."""
    out = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if skip in path.parents:
                continue
            for line, src in _literal_lists(ast.parse(path.read_text()), names):
                out.append(f"{path.relative_to(root.parent)}:{line}: {src}")
    return out


def test_no_list_of_model_types_outside_the_family_modules():
    found = model_type_lists((LIBRARY, PLUGIN), set(FAMILY_SPECS.names()), FAMILY_DIR)
    assert not found, ("model types spelled out by hand (read them from sparse_rl_megatron.models.families: "
                       "family_names(...), family_spec(name).<fact>):\n" + "\n".join(found))


def test_the_scan_sees_a_tuple_a_dict_and_an_if_chain(tmp_path):
    """Seeded: what the project held before the registry (a tuple of MoE types, a dict of tiny models, an ``if`` chain
    over families) is reported, outside the family folder only; a single name passed to a call is not a list."""
    pkg = tmp_path / "pkg"
    (pkg / "families").mkdir(parents=True)
    (pkg / "a.py").write_text('MOE = ("qwen3_moe", "qwen2_moe")\nTINY = {"tiny": "qwen2"}\n'
                              'def f(family):\n    if family == "llama":\n        return 1\n    return g("qwen3")\n')
    (pkg / "families" / "qwen2.py").write_text('NAMES = ("qwen2",)\n')
    found = model_type_lists((pkg,), set(FAMILY_SPECS.names()), pkg / "families")
    assert [f.split(": ")[0] for f in found] == ["pkg/a.py:1", "pkg/a.py:2", "pkg/a.py:4"], found


@pytest.mark.parametrize("name", family_names())
def test_a_family_round_trips_tiny_model_arch_and_weight_map(name, tmp_path):
    """The tiny builder's HF checkpoint -> ``ModelArch`` of its ``config.json`` -> the weight map: the arch names the
    family and has exactly the spec's features; the checkpoint's tensors are the ones the map expects (names and
    shapes), the features' own tensors (``FEATURE_PARAMS``) among them and no other feature's; every Megatron
    parameter is built from them and gives them back bit for bit at TP 1 and 2."""
    spec = family_spec(name)
    build_tiny_model(name, seed=0, init_std=0.2, num_heads=4, num_kv_heads=2).save_pretrained(tmp_path)
    arch = arch_from_hf_config(read_hf_config(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert arch.family == name and W.arch_features(arch) == spec.features
    assert arch.tie_word_embeddings is spec.tiny_tied and (arch.moe is not None) is spec.moe
    hf = {k: v for k, v in saved.items() if not (k == W.HF_LM_HEAD and arch.tie_word_embeddings)}
    assert {k: tuple(v.shape) for k, v in hf.items()} == W.expected_hf_shapes(arch)
    names = W.mcore_param_names(arch)
    delta = {s for f in spec.features for s in W.FEATURE_PARAMS[f]}
    layer0 = {n.removeprefix("decoder.layers.0.") for n in names if W.layer_index(n) == 0}
    assert {s for s in delta if "{e}" not in s} <= layer0
    assert all(s.format(e=e) in layer0 for s in delta if "{e}" in s for e in range(arch.moe.num_experts))
    assert not {s for f in set(FEATURES) - spec.features for s in W.FEATURE_PARAMS[f]} & layer0
    assert {h for n in names for h in W.hf_names(arch, n)} == set(hf)
    for tp in (1, 2):
        back: dict[str, torch.Tensor] = {}
        for n in names:
            shards = [W.hf_to_mcore(arch, n, hf.__getitem__, tp_rank=r, tp_size=tp,
                                    padded_vocab=arch.padded_vocab_size(tp)) for r in range(tp)]
            back.update(W.mcore_to_hf(arch, n, shards))
        assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf), (name, tp)


def test_the_features_are_the_weight_maps():
    assert tuple(W.FEATURE_PARAMS) == FEATURES
    assert all(spec.features <= set(FEATURES) for spec in families())


def test_the_registry_refuses_a_name_twice_and_lists_valid_names():
    with pytest.raises(ValueError, match="model family \\(HF model_type\\) 'qwen2' is already registered"):
        register_family(family_spec("qwen2"))
    with pytest.raises(UnknownNameError, match="unknown model family .*'gpt2'; valid names: llama, qwen2, qwen2_moe"):
        family_spec("gpt2")
    with pytest.raises(ValueError, match="shared_expert needs moe"):
        FamilySpec(name="x", title="X", tiny_config=tiny_config, shared_expert=True)


def test_what_reads_the_registry_sees_each_familys_facts():
    """The tiny ``model_path`` values, the HF engine's families and SGLang's tied-head refusal, family by family."""
    assert TINY_MODELS == {s.tiny_model_path: s.name for s in families() if s.tiny_model_path}
    assert TINY_MODELS[TINY_MODEL] == "qwen2" and TINY_MODELS["tiny-qwen3-moe"] == "qwen3_moe"
    assert family_names(moe=True) == ("qwen2_moe", "qwen3_moe") and family_names(shared_expert=True) == ("qwen2_moe",)
    for spec in families():
        tied = {"model_type": spec.name, "tie_word_embeddings": True}
        assert (tied_moe_head(tied) == spec.name) is (not spec.sglang_ties_head)
        assert tied_moe_head(dict(tied, tie_word_embeddings=False)) is None
    assert tied_moe_head({"model_type": "gpt2", "tie_word_embeddings": True}) is None

