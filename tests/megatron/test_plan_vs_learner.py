"""``sparse-rl plan`` against the real megatron-core learner on CPU (gloo ranks): per GPU, the parameters, the
fp32 main gradients and the Adam state exactly (the distributed optimizer's shards disjoint, summing to all moments, ~1 / DP each), and
the activations each micro-batch keeps for backward (autograd's saved tensors, ``local`` kernels, fp32)
within 0.5% + 512 B (loss padding slots, vocab mask), at TP1 for every model (Qwen2 tied / untied, Llama 3.x, Qwen3) and with full recompute, TP2
and PP2 (static only: 1F1B interleaves the micro-batches) for Qwen3, and DP2 with the distributed optimizer."""
import pytest

import mcore_checks as C
from mcore_harness import MODELS, tp_pp
from mcore_worker import mcore_check


@mcore_check("single", params=[{"model": m} for m in MODELS])
def check_plan_matches_learner_tp1(ctx, model):
    C.check_plan_matches_learner(ctx.refs[model], 1, 1)


@pytest.mark.parametrize("model", MODELS)
def test_plan_matches_learner_tp1(single_launch, model):
    single_launch.check(check_plan_matches_learner_tp1, model=model)


@mcore_check("single")
def check_plan_matches_learner_recompute(ctx):
    C.check_plan_matches_learner(ctx.refs["qwen3"], 1, 1, recompute=True)


def test_plan_matches_learner_with_full_recompute(single_launch):
    """Full recompute (one layer per checkpoint): the forward keeps each layer's input, as planned."""
    single_launch.check(check_plan_matches_learner_recompute)


PAIR_LAYOUTS = ["tp2pp1", "tp1pp2", "tp1pp1"]


@mcore_check("pair", params=[{"at": at} for at in PAIR_LAYOUTS])
def check_plan_matches_learner_layout(ctx, at):
    C.check_plan_matches_learner(ctx.refs["qwen3"], *tp_pp(at))


@mcore_check("pair")
def check_plan_matches_learner_distopt(ctx):
    C.check_plan_matches_learner(ctx.refs["qwen2_untied"], 1, 1, distributed_optimizer=True)


@pytest.mark.parametrize("layout", PAIR_LAYOUTS + ["distopt"])
def test_plan_matches_learner_layouts(pair_launch, layout):
    if layout == "distopt":
        pair_launch.check(check_plan_matches_learner_distopt)
    else:
        pair_launch.check(check_plan_matches_learner_layout, at=layout)
