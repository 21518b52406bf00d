"""The plugin over SGLang's ``triton`` attention backend (the default inner backend on CUDA), run here in
Triton's interpreter on CPU tensors: the kernels and the index-building code a GPU runs, under the plugin.

The assertions are the torch_native tier's (``test_sglang_engine.py``): T=1 log-probs of the sampled tokens
equal the HF reference engine's teacher-forced replay within the tier's bound (``sglang_helpers.logprob_tolerance``),
with the same compression record (events, peak, kept digest), for rkv / snapkv / streamingllm in both scopes, GQA
(4 query heads, 2 KV heads), n = 2 samples sharing each prompt through the radix cache; greedy tokens equal the HF engine's greedy tokens; no
request owns more than B + W slots past its prompt (read from SGLang's allocator); the strict idle and busy
memory checkers stay silent and the pool comes back whole.

The interpreter is slow (a decode step of 14 requests takes seconds; its time grows with the rows), so the module
starts one engine and sends everything it checks in one batch of short responses, two samples per group.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from sglang_helpers import (assert_logprobs_match, assert_matches_reference, full_forward_logprobs, generate_mixed,
                            read_stats, scheduler_env, teacher_forced)

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

SERVER = CompressionConfig(method="rkv", budget=6, window=2, buffer=2)
# The second prompt is longer than B + W: with scope all its first compression copies kept prompt tokens out
# of the radix tree (shared by the group) into each request's own slots.
PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8, 77, 41, 9, 250, 33, 6, 140, 61]]
CONFIGS = [CompressionConfig(method=m, budget=6, window=2, buffer=2, scope=s, sink_tokens=2)
           for m in ("rkv", "snapkv", "streamingllm") for s in ("all", "response")]
RESPONSE_TOKENS = 14
SAMPLES = 2
"""Samples per (method, scope) group: two already share their prompt through the radix cache."""
SPLITS = 2
"""Triton decode KV splits (the GPU default is 8): 2 still runs the split-combining stage, at a quarter of
the interpreter time."""


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    stats = tmp_path_factory.mktemp("stats") / "pool.jsonl"
    config = SGLangEngineConfig(model_path=str(tiny_model_dir), compression=SERVER, dtype="float32",
                                max_total_tokens=2048, kept_digest=True, stats_path=str(stats), inner_backend="triton",
                                extra_args={"triton_attention_num_kv_splits": SPLITS})
    with scheduler_env():
        eng = SGLangRolloutEngine(config)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def batch(engine):
    """Everything in one batch: per (method, scope) a group of ``SAMPLES`` T=1 samples, and 2 greedy requests; all of one
    length (EOS ignored), so every request of the batch is in every forward's pool record. {name: samples}"""
    sampled = SamplingParams(temperature=1.0, max_new_tokens=RESPONSE_TOKENS, seed=3, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=RESPONSE_TOKENS, ignore_eos=True)
    jobs = {f"{c.method}-{c.scope}": (PROMPTS[j % 2], SAMPLES, c, sampled) for j, c in enumerate(CONFIGS)}
    jobs["greedy-rkv-all"] = (PROMPTS[1], 1, CONFIGS[0], greedy)
    jobs["greedy-snapkv-response"] = (PROMPTS[0], 1, CONFIGS[3], greedy)
    return generate_mixed(engine, jobs)


@pytest.mark.parametrize("name", [f"{c.method}-{c.scope}" for c in CONFIGS])
def test_compressed_samples_match_the_teacher_forced_reference(batch, hf_model, name):
    samples = batch[name]
    config = next(c for c in CONFIGS if f"{c.method}-{c.scope}" == name)
    assert len(samples) == SAMPLES and min(s.compression.events for s in samples) >= 2
    assert all(s.compression.kept_digest for s in samples)
    assert_matches_reference(samples, teacher_forced(hf_model, config, samples), hf_model)


def test_greedy_tokens_are_the_reference_engines(batch, hf_model):
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    for name, config in [("greedy-rkv-all", CONFIGS[0]), ("greedy-snapkv-response", CONFIGS[3])]:
        (got,) = batch[name]
        ref = HFRolloutEngine(hf_model, compression=config, show_progress=False)
        (want,) = ref.generate([got.prompt_ids], 1, SamplingParams(temperature=0.0, max_new_tokens=RESPONSE_TOKENS,
                                                                   ignore_eos=True))
        assert got.compression.events >= 2
        assert got.response_ids == want.response_ids, name
        assert (got.compression.events, got.compression.kept_digest) == (want.compression.events,
                                                                          want.compression.kept_digest)


def test_below_budget_is_exactly_dense(engine, batch, hf_model):
    samples = engine.generate(PROMPTS[:1], 2, SamplingParams(temperature=1.0, max_new_tokens=2, seed=4))
    for s in samples:
        assert s.compression.events == 0
        ref = full_forward_logprobs(hf_model, s.prompt_ids, s.response_ids)
        assert_logprobs_match(s.sampler_logprobs, ref, hf_model, s.prompt_ids, s.response_ids,
                              "triton_no_event_vs_forward")


def test_retained_kv_within_budget_and_the_pool_comes_back(engine, batch):
    lines = [x for x in read_stats(Path(engine.config.stats_path)) if x.get("decode")]
    assert lines and any(x["compressing"] for x in lines)
    for x in lines:
        assert x["used"] == x["tree"] + sum(x["owned"]), x
        assert max(x["owned_response"]) <= SERVER.max_candidates, x
    mark = len(read_stats(Path(engine.config.stats_path)))
    engine.client.flush_cache()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        idle = [x for x in read_stats(Path(engine.config.stats_path))[mark:] if x.get("idle")]
        if idle and idle[-1]["available"] == idle[-1]["total"]:
            assert not idle[-1]["leak"] and idle[-1]["evictable"] == 0
            return
        time.sleep(0.2)
    raise AssertionError(f"the pool did not come back: {read_stats(Path(engine.config.stats_path))[-3:]}")
