"""The plugin's refusal of a compressed request SGLang takes off the batch (``hooks._release_req``), reached through
priority preemption (issue 25).

Since issue 25 item 4 a compressed request is never retracted for lack of KV slots (``sglang_ext/admission.py``),
so no other test reaches the refusal. Priority preemption still can: with ``enable_priority_scheduling`` and the
running batch at ``max_running_requests``, a request of higher priority takes the place of a running one
(``PrefillAdder.preempt_to_schedule`` -> ``ScheduleBatch.release_req``). A compressed request cannot resume (its
dense KV is gone), so the plugin refuses it: it ends with ``REFUSED_RETRACTION`` (the engine would redraw it),
the pool stays consistent (strict memory checkers on) and every other sample matches the teacher-forced reference.

It can fail: with the refusal off (``SPARSE_RL_KV_FAULT=no_refusal``: the preempted request is requeued and resumed
as SGLang resumes a dense one) both low-priority requests came back finished (``length``, 40 tokens), none refused.
"""
from __future__ import annotations

import asyncio

import pytest
from sglang_helpers import assert_logprobs_match, assert_matches_reference, scheduler_env, teacher_forced

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams

SERVER = CompressionConfig(method="rkv", budget=8, window=2, buffer=4)
PROMPTS = [[5, 71, 302, 44, 18, 260, 97], [131, 404, 12, 333, 61, 250, 9, 88]]
LOW_TOKENS, HIGH_TOKENS = 40, 8
PREEMPT_AT = 20
"""Response tokens of a low-priority request before the high-priority one is sent: past its first compression
(B + W = 12 response tokens)."""


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    config = SGLangEngineConfig(model_path=str(tiny_model_dir), compression=SERVER, dtype="float32",
                                max_total_tokens=1024, kept_digest=True, max_running_requests=2, max_resubmits=0,
                                extra_args={"enable_priority_scheduling": True})
    with scheduler_env(SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1", SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY="1"):
        eng = SGLangRolloutEngine(config)
    try:
        yield eng
    finally:
        eng.shutdown()


async def _preempt(engine, low: list[dict], high: dict) -> tuple[list[dict], dict, list[bool]]:
    """Both low-priority requests at once (the first streamed, to see its progress); the high-priority one once
    the first has ``PREEMPT_AT`` response tokens (while it still decodes)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    tm = engine.client.engine.tokenizer_manager
    started = asyncio.Event()
    sent_while_decoding = []

    async def one(prompt, params, priority, stream, wait):
        if wait:
            await started.wait()
        obj = GenerateReqInput(input_ids=prompt, sampling_params=params, return_logprob=True, stream=stream,
                               priority=priority)
        out = None
        async for out in tm.generate_request(obj, None):
            if stream and not started.is_set() and len(out["output_ids"]) >= PREEMPT_AT:
                sent_while_decoding.append(not out["meta_info"].get("finish_reason"))
                started.set()
        return out

    lows = [asyncio.ensure_future(one(p, params, 0, i == 0, False)) for i, (p, params) in enumerate(zip(PROMPTS, low))]
    late = asyncio.ensure_future(one(PROMPTS[0][:4], high, 100, False, True))
    outs = await asyncio.gather(*lows)
    started.set()
    return list(outs), await late, sent_while_decoding


def test_a_compressed_request_preempted_for_a_higher_priority_one_is_refused(engine, hf_model):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=LOW_TOKENS, ignore_eos=True, seed=5)
    low = [engine._sampling(sampling, g, 0, 0, None) for g in range(len(PROMPTS))]
    high = engine._sampling(SamplingParams(temperature=1.0, max_new_tokens=HIGH_TOKENS, ignore_eos=True, seed=6),
                            9, 0, 0, None)
    outs, high_out, sent_while_decoding = engine.client._wait(_preempt(engine, low, high))
    assert sent_while_decoding == [True]
    refused = [g for g, out in enumerate(outs) if engine._refused(out)]
    assert len(refused) == 1, [out["meta_info"].get("finish_reason") for out in outs]
    (g, out), = [(g, out) for g, out in enumerate(outs) if g not in refused]
    kept = engine._sample(out, PROMPTS[g], PROMPTS[g], g, 0, sampling)
    (want,) = teacher_forced(hf_model, SERVER, [kept])
    assert want.compression.events > 0
    if g == 0:   # streamed: SGLang sent the plugin's record with the first chunk only; its log-probs are checked
        assert_logprobs_match(kept.sampler_logprobs, want.sampler_logprobs, hf_model, kept.prompt_ids,
                              kept.response_ids, "preemption survivor")
    else:
        assert_matches_reference([kept], [want], hf_model)
    high_sample = engine._sample(high_out, PROMPTS[0][:4], PROMPTS[0][:4], 9, 0, sampling)
    assert_matches_reference([high_sample], teacher_forced(hf_model, SERVER, [high_sample]), hf_model)
    # the pool is consistent afterwards (a leak or double free would have ended the scheduler): a plain batch runs
    again = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=7))
    assert_matches_reference(again, teacher_forced(hf_model, SERVER, again), hf_model)
