"""One optimizer step of the corrected GRPO loss == HF + torch AdamW on the whole batch, at every layout.

The reference (``mcore_reference.py``) runs the algorithm's ``micro_batch_loss`` on all six rows at once in a
single process; the learner splits rows over DP ranks and into 3 micro-batches (token budget 24) and
shards over TP / PP. Tolerance: ``STEP_ATOL = lr / 100`` on every weight (reasoning in ``mcore_spec.py``);
the test also asserts the reference moved weights by > 10 x the tolerance, and that tied embedding copies on
the first and last pipeline stage stay bit-identical.
"""
import pytest
import torch

import torch.distributed as dist

import mcore_checks as C
from mcore_harness import LAYOUTS, MODELS, at_every_layout, tp_pp
from mcore_worker import mcore_check


@at_every_layout
def check_train(ctx, layout, model):
    """On the learner of check_build, after the checks of its untrained weights (the modules before)."""
    C.check_train_step(ctx.learners[model], ctx.refs[model])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_matches_reference(request, layout, model):
    fixture, tag = LAYOUTS[layout]
    request.getfixturevalue(fixture).check(check_train, layout=tag, model=model)


@mcore_check("single")
def check_nan_guard_tp1(ctx):
    C.check_nan_guard(C.learner(ctx.refs["qwen2_tied"]), ctx.refs["qwen2_tied"])


@mcore_check("pair")
def check_nan_guard_tp1pp2(ctx):
    C.check_nan_guard(C.learner(ctx.refs["qwen2_tied"], 1, 2), ctx.refs["qwen2_tied"])


@pytest.mark.parametrize("fixture,check", [("single_launch", check_nan_guard_tp1),
                                           ("pair_launch", check_nan_guard_tp1pp2)],
                         ids=["single_launch-nan_guard_tp1", "pair_launch-nan_guard_tp1pp2"])
def test_nan_loss_skips_step_and_keeps_weights(request, fixture, check):
    """NaN advantages make the loss NaN: the step is skipped on every rank (counted), weights are bit-identical,
    and the next finite step equals the reference first step (optimizer state and LR schedule untouched)."""
    request.getfixturevalue(fixture).check(check)


@mcore_check(("pair", "grid"))
def check_distributed_optimizer_train(ctx):
    # data parallel x TP with Megatron's DistributedOptimizer (CPU: W7 patch at construction)
    world = dist.get_world_size()
    lrn = C.learner(ctx.refs["qwen2_untied"], 2 if world >= 4 else 1, 1, distributed_optimizer=True)
    assert lrn.layout.dp >= 2
    assert "DistributedOptimizer" in type(lrn.optimizer.chained_optimizers[0]).__name__
    C.check_train_step(lrn, ctx.refs["qwen2_untied"])


@pytest.mark.parametrize("fixture", ["pair_launch", "grid_launch"])
def test_distributed_optimizer_step(request, fixture):
    """Megatron's DistributedOptimizer (DP = 2, and DP = 2 x TP = 2) matches the reference after one step."""
    request.getfixturevalue(fixture).check(check_distributed_optimizer_train)


@mcore_check("single")
def check_recompute_full_train(ctx) -> None:
    """Full activation recompute (the reference run's setting: uniform, one layer per checkpoint) runs on CPU
    and one step equals the HF reference; the model really recomputes (megatron's CheckpointFunction runs)."""
    from megatron.core.tensor_parallel import random as mrandom

    ref = ctx.refs["qwen2_untied"]
    lrn = C.learner(ref, megatron_overrides=dict(recompute_granularity="full", recompute_method="uniform",
                                                 recompute_num_layers=1))
    assert lrn.describe().endswith("spec=local fusions=none recompute_granularity=full"), lrn.describe()
    calls = []
    real_backward = mrandom.CheckpointFunction.backward

    def counting_backward(ctx, *grads):
        calls.append(1)
        return real_backward(ctx, *grads)

    mrandom.CheckpointFunction.backward = staticmethod(counting_backward)
    try:
        C.check_train_step(lrn, ref)
    finally:
        mrandom.CheckpointFunction.backward = staticmethod(real_backward)
    assert len(calls) == 2 * 3, calls  # 2 layers x 3 micro-batches recomputed in backward


def test_full_activation_recompute_step(single_launch):
    """recompute_granularity=full (uniform, 1 layer), as in the reference run: megatron's CheckpointFunction
    re-runs every layer in backward (CUDA RNG state calls covered on CPU) and the step equals the reference."""
    single_launch.check(check_recompute_full_train)


@mcore_check("single")
def check_empty_slice_advances_lr(ctx):
    """A slice the correction emptied takes no optimizer step but moves the lr schedule on: after 2 slices
    (the second all rejected) of a linear decay over 4 steps, the lr is lr / 2, as after two steps."""
    import dataclasses

    from mcore_spec import learner_config, sequences
    from sparse_rl_megatron.learner import Learner
    from sparse_rl_megatron.rollout.sample import Sample
    from sparse_rl_megatron.trainer.optimize import optimizer_steps
    from sparse_rl_megatron.trainer.step import RolloutBatch

    ref = ctx.refs["qwen2_tied"]
    cfg = learner_config(ref["path"])
    cfg.optim = dataclasses.replace(cfg.optim, lr_decay_style="linear", lr_decay_steps=4)
    lrn = Learner(cfg)
    prepared = ref["prepared"]
    drop = torch.tensor([False, False, False, True, True, True])
    prepared = dataclasses.replace(prepared, loss_mask=prepared.loss_mask & ~drop[:, None],
                                   keep=prepared.keep & ~drop,
                                   advantages=torch.where(drop, 0.0, prepared.advantages))
    prompts, responses = sequences()
    samples = [Sample(prompt_ids=p.tolist(), response_ids=r.tolist(), sampler_logprobs=torch.zeros(len(r)))
               for p, r in zip(prompts, responses)]
    metrics = optimizer_steps(lrn, RolloutBatch(samples, C.sequence_batch(), prepared, ref["ref_lp"]), 2)
    assert metrics["train/optimizer_steps"] == 1.0 and metrics["train/empty_slices"] == 1.0, metrics
    assert lrn.steps == 1, lrn.steps
    lr = cfg.optim.lr
    assert abs(lrn.optimizer.param_groups[0]["lr"] - lr / 2) < 1e-12 * lr, lrn.optimizer.param_groups[0]["lr"]
    assert abs(metrics["train/lr"] - lr / 2) < 1e-12 * lr, metrics


def test_empty_slice_still_steps_the_lr_schedule(single_launch):
    """trainer.optimize: a slice whose samples were all rejected takes no optimizer step, but the lr schedule
    moves on, so a corrected run's lr does not lag an uncorrected one's under a decaying schedule."""
    single_launch.check(check_empty_slice_advances_lr)


FEWER_ROWS_MODELS = ("qwen2_tied", "qwen2_untied")


@mcore_check("pair", params=[{"at": "tp1pp1", "model": m} for m in FEWER_ROWS_MODELS])
@mcore_check("grid", params=[{"at": "tp2pp1", "model": m} for m in FEWER_ROWS_MODELS])
def check_fewer_rows_than_dp(ctx, at, model):
    C.check_fewer_rows_than_dp(C.learner(ctx.refs[model], *tp_pp(at)), ctx.refs[model])


@pytest.mark.parametrize("model", FEWER_ROWS_MODELS)
@pytest.mark.parametrize("fixture,layout", [("pair_launch", "tp1pp1"), ("grid_launch", "tp2pp1")])
def test_fewer_rows_than_data_parallel_ranks(request, fixture, layout, model):
    """A one-row batch at DP = 2 (and TP = 2 x DP = 2): the rank without a row runs a padding micro-batch; log-probs
    equal HF's and the step equals the HF step on that row alone (it raised 'cannot split 1 rows over 2
    data-parallel ranks' in the trainer's weight-sync probe)."""
    request.getfixturevalue(fixture).check(check_fewer_rows_than_dp, at=layout, model=model)
