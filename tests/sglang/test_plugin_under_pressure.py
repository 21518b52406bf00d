"""The plugin under memory pressure, against the HF reference engine (issue 25).

A KV pool of 300 tokens, so a freed slot is handed out again within a few steps; the radix cache on; GRPO groups
(3 prompts x n = 4) sharing prompts; prompts split into 8-token prefill chunks; rkv in both scopes and dense
(``method: none``) requests side by side; a second round whose prompts are already in the tree. Every finished
sample is replayed by ``HFRolloutEngine.teacher_forced``. The plugin compares its tables with SGLang's rows before
every forward (``check_tables``): before issue 25 the radix checkpoint repointed rows at the tree's slots after
prefill, the plugin's table kept the freed duplicates, and requests read other requests' K/V (1.8-6.1 nats off).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from sglang_helpers import assert_matches_reference, generate_mixed, read_stats, scheduler_env, teacher_forced

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

POOL = 300
CHUNK = 8
SERVER = CompressionConfig(method="rkv", budget=12, window=3, buffer=4)
PROMPTS = [[5, 17, 42], [300, 12, 8, 77, 41, 9, 250, 33, 6], list(range(100, 121))]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=28, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    stats = tmp_path_factory.mktemp("stats") / "pool.jsonl"
    config = SGLangEngineConfig(model_path=str(tiny_model_dir), compression=SERVER, dtype="float32",
                                max_total_tokens=POOL, kept_digest=True, check_tables=True, stats_path=str(stats),
                                extra_args={"chunked_prefill_size": CHUNK})
    with scheduler_env():
        eng = SGLangRolloutEngine(config)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("scope", ["response", "all"])
def test_groups_sharing_prompts_in_a_reused_pool_match_the_reference(engine, hf_model, scope):
    config = replace(SERVER, scope=scope)
    for _ in range(2):   # the second round's prompts are in the radix tree already
        samples = engine.generate(PROMPTS, 4, SAMPLING, compression=config)
        assert min(s.compression.events for s in samples) >= 1
        assert_matches_reference(samples, teacher_forced(hf_model, config, samples), hf_model)


def test_dense_and_compressed_requests_side_by_side(engine, hf_model):
    """Dense requests (the weight-sync probe, dense evaluation) read the same table; one batch of three groups."""
    jobs = {"dense": (PROMPTS[2], 4, CompressionConfig(), SAMPLING),
            "all": (PROMPTS[1], 4, replace(SERVER, scope="all"), SAMPLING),
            "response": (PROMPTS[0], 4, SERVER, SAMPLING)}
    for _ in range(2):
        for name, samples in generate_mixed(engine, jobs).items():
            assert_matches_reference(samples, teacher_forced(hf_model, jobs[name][2], samples), hf_model)


def test_the_pool_was_under_pressure(engine):
    """The runs above packed the pool (so freed slots were handed out again) and split prompts into chunks."""
    lines = read_stats(Path(engine.config.stats_path))
    decodes = [x for x in lines if x.get("decode")]
    assert max(x["used"] for x in decodes) > POOL // 2
    assert any(not x["decode"] and max(x["phys"]) == CHUNK for x in lines if "decode" in x)
    assert engine.resubmitted == 0


def test_beam_search_is_refused_per_request(engine):
    # without log-probs, which SGLang refuses for beams itself
    with pytest.raises(ValueError, match="beam_width=3: beam search is not supported by sparse_kv"):
        engine.client.engine.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 8, "beam_width": 3})
    assert len(engine.generate(PROMPTS[:1], 2, SamplingParams(max_new_tokens=4))) == 2   # the server keeps serving
