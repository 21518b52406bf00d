"""A step's groups shared out over several HF engines sample what one engine sampling them all samples, up to
float rounding: every sample is seeded by its global group id (``generate(group_ids=...)``), so a shard draws
the same uniforms for a group as the whole batch; what differs is the batch a row is computed in, and CPU BLAS
(MKL / oneDNN) may pick another kernel and blocking for another batch shape, so a row's log-probs move by
float rounding (measured: up to ~1e-6 on some CPUs, 0 on others). The check: the same tokens, except where
a draw landed within that rounding of a bucket edge (``numerics.flip_probability``: with ~1e-6 and at most ~500
tokens a case, below 1e-3, so at most one sample per case may differ), and log-probs within
``numerics.forward_logprob_bound`` (the worst case of the float error model, ~1e-3 here, far above the rounding
and far below what a wrong key, position or temperature moves)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import numerics
from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.rollout.kv_cache import align_keys
from sparse_rl_megatron.models.tiny import build_tiny_model

MAX_FLIPPED = 1
"""Samples per case whose tokens may differ: P(>= 1 flip) <= flip_probability(500, 1e-6) = 1e-3; P(>= 2) ~ 1e-6."""


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("qwen2", seed=0, init_std=0.2)


def _logprob_atol(model, samples) -> float:
    """The bound for these samples: the model's reductions over the longest key span, at its largest logit."""
    longest = max(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids))
    keys = align_keys(len(longest.prompt_ids) + len(longest.response_ids))
    with torch.no_grad():
        scale = model(torch.tensor([longest.prompt_ids + longest.response_ids])).logits.abs().max().item()
    return numerics.forward_logprob_bound(numerics.hf_config_reductions(model.config, keys),
                                          model.config.vocab_size, scale)


def _compare(whole, parts, tol: float) -> int:
    """Assert the structure is the same and log-probs agree where the tokens do; return how many differ."""
    assert [(s.group_id, s.index_in_group, s.prompt_ids) for s in whole] == [
        (s.group_id, s.index_in_group, s.prompt_ids) for s in parts]
    flipped = 0
    for a, b in zip(whole, parts):
        if a.response_ids != b.response_ids:
            flipped += 1
            continue
        assert (a.finish_reason, a.compression) == (b.finish_reason, b.compression)
        for x, y in ((a.sampler_logprobs, b.sampler_logprobs), (a.sampler_logprobs_scaled, b.sampler_logprobs_scaled)):
            diff = (x - y).abs().max().item() if len(x) else 0.0
            assert diff <= tol, f"group {a.group_id} sample {a.index_in_group}: |log-prob diff| {diff:.3g} > {tol:.3g}"
    return flipped


@pytest.mark.parametrize("case", range(6))
def test_shards_sampled_apart_give_the_whole_batch_samples_up_to_rounding(model, case):
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
    assert len(parts) == len(whole)
    tol = _logprob_atol(model, whole)
    assert _compare(whole, parts, tol) <= MAX_FLIPPED


def test_the_comparison_catches_a_seeded_defect(model):
    """A sample's log-probs shifted by a rounding-sized amount pass; shifted by 1e-2 nats (a wrong temperature
    scale, a stale key) fail; a swapped pair of groups fails on structure."""
    sampling = SamplingParams(max_new_tokens=8, seed=0)
    whole = HFRolloutEngine(model, show_progress=False).generate([[5, 6, 7], [9, 10]], 2, sampling)
    tol = _logprob_atol(model, whole)
    assert 1e-6 < tol < 1e-2

    def shifted(by):
        return [dataclasses.replace(s, sampler_logprobs=s.sampler_logprobs + by) for s in whole]

    assert _compare(whole, shifted(1e-7), tol) == 0
    with pytest.raises(AssertionError, match="log-prob diff"):
        _compare(whole, shifted(1e-2), tol)
    with pytest.raises(AssertionError):
        _compare(whole, whole[2:] + whole[:2], tol)


def test_group_ids_are_one_distinct_id_per_prompt(model):
    engine = HFRolloutEngine(model, show_progress=False)
    sampling = SamplingParams(max_new_tokens=2, seed=0)
    with pytest.raises(ValueError, match=r"group_ids must be 2 distinct ids, one per prompt; got \[3, 3\]"):
        engine.generate([[5, 6], [7]], 1, sampling, group_ids=[3, 3])
    with pytest.raises(ValueError, match="group_ids must be 2 distinct ids"):
        engine.generate([[5, 6], [7]], 1, sampling, group_ids=[3])
    assert [s.group_id for s in engine.generate([[5, 6], [7]], 2, sampling, group_ids=[9, 4])] == [9, 9, 4, 4]


@pytest.mark.parametrize("case", range(3))
def test_mixed_budgets_in_one_call_give_each_budget_run_alone(model, case):
    """Per-request budgets (the adaptive budget, issue 27): one call with a budget per prompt samples what an engine
    built with each budget samples for that budget's prompts alone (same global group ids), up to rounding; every
    sample carries its own budget, and the budget bounds its KV (peak = B + W once compressed)."""
    rng = random.Random(100 + case)
    method = ["rkv", "snapkv", "h2o"][case]
    base = CompressionConfig(method=method, budget=12, window=2, buffer=4, scope=rng.choice(["all", "response"]))
    gen = torch.Generator().manual_seed(case)
    prompts = [torch.randint(3, model.config.vocab_size, (rng.randint(2, 20),), generator=gen).tolist()
               for _ in range(5)]
    budgets = [rng.choice([8, 12, 24]) for _ in prompts]
    budgets[0], budgets[1] = 8, 24  # at least two budgets
    sampling = SamplingParams(max_new_tokens=40, seed=case, ignore_eos=True)
    engine = HFRolloutEngine(model, compression=CompressionConfig(), show_progress=False, max_batch_size=4)
    mixed = engine.generate(prompts, 2, sampling, compression=base, budgets=budgets)
    alone = []
    for b in sorted(set(budgets)):
        share = [g for g, x in enumerate(budgets) if x == b]
        single = HFRolloutEngine(model, compression=dataclasses.replace(base, budget=b), show_progress=False)
        alone += single.generate([prompts[g] for g in share], 2, sampling, group_ids=share)
    alone.sort(key=lambda s: (s.group_id, s.index_in_group))
    assert _compare(mixed, alone, _logprob_atol(model, mixed)) <= MAX_FLIPPED
    for s in mixed:
        b = budgets[s.group_id]
        assert (s.compression.method, s.compression.budget) == (method, b)
        assert s.compression.events >= 1 and s.compression.peak_kv_tokens <= max(b + 4, len(s.prompt_ids) + 1)
    assert {s.compression.peak_kv_tokens for s in mixed if budgets[s.group_id] == 24} != {
        s.compression.peak_kv_tokens for s in mixed if budgets[s.group_id] == 8}


def test_per_call_compression_and_bad_budgets(model):
    sampling = SamplingParams(max_new_tokens=30, seed=0, ignore_eos=True)
    config = CompressionConfig(method="rkv", budget=8, window=2, buffer=4)
    built = HFRolloutEngine(model, compression=config, show_progress=False).generate([[5, 6, 7]], 2, sampling)
    engine = HFRolloutEngine(model, show_progress=False)  # dense by default
    per_call = engine.generate([[5, 6, 7]], 2, sampling, compression=config)
    assert [(s.response_ids, s.compression) for s in per_call] == [(s.response_ids, s.compression) for s in built]
    assert engine.generate([[5, 6, 7]], 1, sampling)[0].compression.budget is None  # the engine's own is unchanged
    with pytest.raises(ValueError, match="one budget per prompt"):
        engine.generate([[5, 6], [7]], 1, sampling, compression=config, budgets=[8])
    with pytest.raises(ValueError, match="dense"):
        engine.generate([[5, 6]], 1, sampling, budgets=[8])
    with pytest.raises(ValueError, match="budget must be > window"):
        engine.generate([[5, 6]], 1, sampling, compression=config, budgets=[2])
