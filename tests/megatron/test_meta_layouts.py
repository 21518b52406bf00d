"""Qwen2.5 1.5B-72B, Qwen3 8B/32B and the Qwen3 mixtures of experts 30B-A3B / 235B-A22B at cluster layouts (the
recipes' expert-parallel ones), proven on one CPU process without weights.

The checks below (run by ``workers/w_meta.py``, whose helpers they call) build every rank's megatron-core stage on the meta device (a fake process group
reports the rank; see its docstring) from the bundled real configs (``sparse_rl_megatron/models/configs``),
and checks shard shapes against the weight map, exactly-once coverage of every HF tensor, and the parameter
count against the HF model built on meta. One process for all cases (about 15 s of CPU).
"""
import pytest

import w_meta as W
from mcore_harness import launch
from mcore_worker import mcore_check

# (model, TPxPP): the layouts a cluster would use, as the issue lists them, plus a second layout per model.
CASES = [
    ("qwen2.5-1.5b", "1x1"), ("qwen2.5-1.5b", "2x1"), ("qwen2.5-1.5b", "1x2"),
    ("qwen2.5-3b", "2x1"), ("qwen2.5-3b", "2x2"),
    ("qwen2.5-7b", "4x1"), ("qwen2.5-7b", "2x2"),
    ("qwen2.5-14b", "8x1"), ("qwen2.5-14b", "4x2"),
    ("qwen2.5-32b", "8x1"), ("qwen2.5-32b", "4x2"),
    ("qwen2.5-72b", "8x4"), ("qwen2.5-72b", "8x2"),
    ("qwen3-8b", "8x1"), ("qwen3-8b", "4x2"),
    ("qwen3-32b", "8x1"), ("qwen3-32b", "8x2"),
    # TPxPPxEPxETP: the 30B-A3B recipes (one node: EP 8; two nodes: EP 8 x expert DP 2, the same shards per GPU), a
    # TP 2 x PP 2 x EP 4 layout of it, and
    # the 235B-A22B on paper (docs/memory-planning.md: 128 GPUs, TP 4 x PP 2 x DP 16, EP 64)
    ("qwen3-30b-a3b", "1x1x8x1"), ("qwen3-30b-a3b", "2x2x4x1"),
    ("qwen3-235b-a22b", "4x2x64x1"),
]
MODELS = list(dict.fromkeys(m for m, _ in CASES))


@pytest.fixture(scope="module")
def meta_launch(tmp_path_factory):
    return launch("w_meta.py", 1, [], tmp_path_factory.mktemp("meta_results"), timeout=300)


def test_every_bundled_model_is_covered():
    from sparse_rl_megatron.models.catalog import known_models

    assert sorted(MODELS) == known_models()


@mcore_check("meta", params=[{"model": m} for m in MODELS])
def check_hf(ctx, model):
    W.check_hf(model, ctx.state)


@pytest.mark.parametrize("model", MODELS)
def test_hf_meta_model_matches_weight_map(meta_launch, model):
    """transformers' model of the config, built on meta, holds exactly the tensors (names, shapes) the weight map
    expects (q/k norms for Qwen3, QKV biases for Qwen2.5, lm_head only when untied)."""
    meta_launch.check(check_hf, model=model)


@mcore_check("meta", params=[{"model": m, "layout": layout} for m, layout in CASES])
def check_layout(ctx, model, layout):
    """TPxPP[xEPxETP]: every rank's shards against the weight map (``w_meta.check_layout``)."""
    tp, pp, *experts = (int(x) for x in layout.split("x"))
    ep, etp = experts if experts else (1, None)
    W.check_layout(*ctx.state[model], tp, pp, ep, etp)


@pytest.mark.parametrize("model,layout", CASES)
def test_layout_shards_cover_hf_exactly_once(meta_launch, model, layout):
    meta_launch.check(check_layout, model=model, layout=layout)
