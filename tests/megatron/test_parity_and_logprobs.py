"""Megatron model == HF transformers for the same weights, at TP1 / TP2 / PP2 / DP2 / TP2xPP2.

Models (``workers/mcore_spec.py``): Qwen2 tied (14 q / 2 kv heads), Qwen2 untied (28 q / 4 kv heads, the
Qwen2.5-7B ratio), Llama 3.x (no biases, llama3 RoPE scaling), Qwen3 tied (q/k norms, head_dim != hidden /
heads); vocab 250 padded to 256 in Megatron; norm weights randomised. fp32 throughout.
"""
import pytest

import mcore_checks as C
from mcore_harness import LAYOUTS, MODELS
from mcore_worker import mcore_check

PER_MODEL = [{"model": m} for m in MODELS]


# TP = 1 (the single launch): each model's learner is built once, kept in ctx.state for the checks of
# test_checkpoints.py and test_train_step.py (the launch imports those modules after this one).
@mcore_check("single", params=PER_MODEL)
def check_build_tp1(ctx, model):
    ctx.state[model] = C.learner(ctx.refs[model])


@mcore_check("single", params=PER_MODEL)
def check_parity_tp1(ctx, model):
    C.check_logits(ctx.state[model], ctx.refs[model])


@mcore_check("single", params=PER_MODEL)
def check_logprobs_tp1(ctx, model):
    C.check_logprobs(ctx.state[model], ctx.refs[model])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_hf(request, layout, model):
    """max |logits - HF logits| <= 1e-4 on a [2, 24] batch (TP-gathered, padded vocab columns dropped)."""
    fixture, tag = LAYOUTS[layout]
    result = request.getfixturevalue(fixture)
    if layout == "TP1":
        result.check(check_build_tp1, model=model)
        result.check(check_parity_tp1, model=model)
        return
    result.check(f"{tag}_build_{model}")
    result.check(f"{tag}_parity_{model}")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_match_hf_log_softmax(request, layout, model):
    """Learner.logprobs == log_softmax(HF logits) at the sampled tokens (<= 1e-4) in the padded and packed
    layouts, exact zeros at padding, chunked == unchunked (<= 1e-6); identical on every rank."""
    fixture, tag = LAYOUTS[layout]
    if layout == "TP1":
        request.getfixturevalue(fixture).check(check_logprobs_tp1, model=model)
        return
    request.getfixturevalue(fixture).check(f"{tag}_logprobs_{model}")


def test_sequence_parallel_tp2(pair_launch):
    """megatron_overrides.sequence_parallel at TP = 2 (with full recompute, as the reference run): refused
    naming the torch norms of the local spec; with norms that take part in sequence parallel (what TE gives),
    the sequence-split hidden states are gathered before the response positions are indexed, lengths are padded
    to TP, log-probs match log_softmax(HF) in both layouts and one step matches the reference."""
    pair_launch.check("sequence_parallel_tp2")
