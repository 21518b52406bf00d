"""Megatron model == HF transformers for the same weights, at TP1 / TP2 / PP2 / DP2 / TP2xPP2.

Models (``workers/mcore_spec.py``): Qwen2 tied (14 q / 2 kv heads), Qwen2 untied (28 q / 4 kv heads, the
Qwen2.5-7B ratio), Llama 3.x (no biases, llama3 RoPE scaling), Qwen3 tied (q/k norms, head_dim != hidden /
heads); vocab 250 padded to 256 in Megatron; norm weights randomised. fp32 throughout.
"""
import pytest

import mcore_checks as C
from mcore_harness import LAYOUTS, MODELS, at_every_layout, tp_pp
from mcore_worker import mcore_check


# Each layout's learners (one per model) are built once and kept in ctx.learners for the checks of
# test_checkpoints.py and test_train_step.py: the launches run a layout's checks together, before the next
# layout's, in module order (parity, log-probs, export, then the train step).
@at_every_layout
def check_build(ctx, layout, model):
    if getattr(ctx, "layout", None) != layout:  # the previous layout's learners go first
        ctx.learners, ctx.layout = {}, layout
    ctx.learners[model] = C.learner(ctx.refs[model], *tp_pp(layout))


@at_every_layout
def check_parity(ctx, layout, model):
    C.check_logits(ctx.learners[model], ctx.refs[model])


@at_every_layout
def check_logprobs(ctx, layout, model):
    C.check_logprobs(ctx.learners[model], ctx.refs[model])
    C.same_on_all_ranks(ctx.learners[model].logprobs(C.sequence_batch()))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_hf(request, layout, model):
    """max |logits - HF logits| <= 1e-4 on a [2, 24] batch (TP-gathered, padded vocab columns dropped)."""
    fixture, tag = LAYOUTS[layout]
    result = request.getfixturevalue(fixture)
    result.check(check_build, layout=tag, model=model)
    result.check(check_parity, layout=tag, model=model)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_match_hf_log_softmax(request, layout, model):
    """Learner.logprobs == log_softmax(HF logits) at the sampled tokens (<= 1e-4) in the padded and packed
    layouts, exact zeros at padding, chunked == unchunked (<= 1e-6); identical on every rank."""
    fixture, tag = LAYOUTS[layout]
    request.getfixturevalue(fixture).check(check_logprobs, layout=tag, model=model)


@mcore_check("pair")
def check_sequence_parallel_tp2(ctx):
    C.check_sequence_parallel(ctx.refs["qwen2_untied"])


def test_sequence_parallel_tp2(pair_launch):
    """megatron_overrides.sequence_parallel at TP = 2 (with full recompute, as the reference run): refused
    naming the torch norms of the local spec; with norms that take part in sequence parallel (what TE gives),
    the sequence-split hidden states are gathered before the response positions are indexed, lengths are padded
    to TP, log-probs match log_softmax(HF) in both layouts and one step matches the reference."""
    pair_launch.check(check_sequence_parallel_tp2)
