"""TriAttention in the sparse_kv plugin against the HF reference engine (online query centers).

One in-process engine (radix cache on, strict memory checks on) started with triattention, B = 12, alpha = 3,
W = 4, kept digests on. The plugin sums each request's pre-RoPE queries per layer and query head
(``sglang_ext/query_centers``); ``HFRolloutEngine.teacher_forced`` replays the sampled tokens with the same
compressor, whose cache sums them its own way (``rollout/kv_cache``): same log-probs, events, peaks and kept sets.
"""
from __future__ import annotations

import pytest
from sglang_helpers import assert_matches_reference, scheduler_env, teacher_forced

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

SERVER = CompressionConfig(method="triattention", budget=12, window=3, buffer=4)
# Mixed lengths, shared by each group's samples; the last prompt is longer than B + W (scope all: the first
# compression already drops prompt tokens).
PROMPTS = [[5, 17, 42], [300, 12, 8, 77, 41, 9, 250, 33, 6], list(range(100, 121))]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    config = SGLangEngineConfig(model_path=str(tiny_model_dir), compression=SERVER, dtype="float32",
                                max_total_tokens=2048, kept_digest=True)
    with scheduler_env():
        eng = SGLangRolloutEngine(config)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("scope", ["all", "response"])
def test_triattention_matches_teacher_forced_reference(engine, hf_model, scope):
    config = CompressionConfig(method="triattention", budget=12, window=3, buffer=4, scope=scope)
    samples = engine.generate(PROMPTS, 3, SamplingParams(temperature=1.0, max_new_tokens=28, seed=1),
                              compression=config)
    assert max(s.compression.events for s in samples) >= 3
    assert all(s.compression.method == "triattention" and s.compression.kept_digest for s in samples)
    assert_matches_reference(samples, teacher_forced(hf_model, config, samples), hf_model)


def test_a_query_window_method_runs_beside_it(engine, hf_model):
    """A request overriding the method on a triattention server scores with its query ring as usual."""
    config = CompressionConfig(method="snapkv", budget=12, window=3, buffer=4)
    samples = engine.generate(PROMPTS[1:], 2, SamplingParams(temperature=1.0, max_new_tokens=24, seed=2),
                              compression=config)
    assert max(s.compression.events for s in samples) >= 2
    assert_matches_reference(samples, teacher_forced(hf_model, config, samples), hf_model)
