"""A step's groups shared out over several HF engines give exactly the samples of one engine sampling them all:
every sample is seeded by its global group id (``generate(group_ids=...)``), and the engine's numerics do not
depend on what a row is batched with (``kv_cache.KEY_ALIGN``, ``hf_forward.MIN_GEMM_ROWS``). Before both, shards
differed from the whole batch by ~1e-6 in log-prob."""
from __future__ import annotations

import random

import pytest
import torch

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.utils.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("qwen2", seed=0, init_std=0.2)


def _same(a, b) -> bool:
    return (a.group_id, a.index_in_group, a.response_ids, a.prompt_ids, a.finish_reason, a.compression) == (
        b.group_id, b.index_in_group, b.response_ids, b.prompt_ids, b.finish_reason, b.compression) and torch.equal(
        a.sampler_logprobs, b.sampler_logprobs) and torch.equal(a.sampler_logprobs_scaled, b.sampler_logprobs_scaled)


@pytest.mark.parametrize("case", range(6))
def test_shards_sampled_apart_equal_the_whole_batch_bit_for_bit(model, case):
    rng = random.Random(case)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(3, 6))]
    method = ["none", "rkv", "snapkv", "h2o", "rkv", "streamingllm"][case]
    compression = CompressionConfig() if method == "none" else CompressionConfig(
        method=method, budget=rng.choice([8, 24]), window=2, buffer=rng.choice([4, 8]),
        scope=rng.choice(["all", "response"]))
    gen = torch.Generator().manual_seed(case)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    sampling = SamplingParams(temperature=rng.choice([1.0, 0.7]), top_p=rng.choice([1.0, 0.9]),
                              max_new_tokens=rng.randint(6, 28), seed=case)
    n = rng.randint(1, 3)
    whole = HFRolloutEngine(model, compression=compression, show_progress=False,
                            max_batch_size=rng.choice([3, 64])).generate(prompts, n, sampling)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    cut = rng.randint(1, len(order) - 1)
    shards = [sorted(order[:cut]), sorted(order[cut:])]
    engine = HFRolloutEngine(model, compression=compression, show_progress=False, max_batch_size=rng.choice([2, 64]))
    parts = [s for share in shards for s in engine.generate([prompts[g] for g in share], n, sampling, group_ids=share)]
    parts.sort(key=lambda s: (s.group_id, s.index_in_group))
    assert len(parts) == len(whole) and all(_same(a, b) for a, b in zip(whole, parts))


def test_group_ids_are_one_distinct_id_per_prompt(model):
    engine = HFRolloutEngine(model, show_progress=False)
    sampling = SamplingParams(max_new_tokens=2, seed=0)
    with pytest.raises(ValueError, match=r"group_ids must be 2 distinct ids, one per prompt; got \[3, 3\]"):
        engine.generate([[5, 6], [7]], 1, sampling, group_ids=[3, 3])
    with pytest.raises(ValueError, match="group_ids must be 2 distinct ids"):
        engine.generate([[5, 6], [7]], 1, sampling, group_ids=[3])
    assert [s.group_id for s in engine.generate([[5, 6], [7]], 2, sampling, group_ids=[9, 4])] == [9, 9, 4, 4]
