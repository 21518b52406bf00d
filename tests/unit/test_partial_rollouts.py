"""Partial rollouts (issue 54) on the reference engine: a continued response is the response it continues (the
engine's ``prefixes``), the step trains whole groups only, every token keeps its weight version and its sampler
log-prob, stale groups are dropped, and the samples in flight round-trip through a checkpoint's state exactly."""
from __future__ import annotations

import json

import numerics
import pytest
import torch

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.rewards.exact import ExactReward
from sparse_rl_megatron.rollout.config import PartialRolloutConfig
from sparse_rl_megatron.rollout.continuation import extend, is_finished
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.rollout.stopping import StopChecker
from sparse_rl_megatron.trainer.engine_pool.pool import EnginePool
from sparse_rl_megatron.trainer.partial_rollouts import PartialRollouts

PROMPTS = ["Let x be a real number such that", "The answer is", "First, 2 + 3 = 5. Then"]
LIMIT = 9
"""max_new_tokens of the partial-rollout steps (EOS ignored: every response runs to it, over several calls)."""


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("qwen2", init_std=0.2, seed=1)


def _engine(model, tok, **kw):
    return HFRolloutEngine(model, tok, show_progress=False, **kw)


def test_a_continued_greedy_response_is_the_uninterrupted_one(model, tok):
    """Dense and greedy: 4 tokens, then 6 more with the 4 as prefix = 10 tokens in one call (tokens equal, log-probs
    within the engine's float tolerance), and the continuation's samples hold only the new tokens."""
    engine = _engine(model, tok)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    whole = engine.generate(PROMPTS, 1, greedy)
    head = engine.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    tail = engine.generate([s.prompt_ids for s in head], 1, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                                           ignore_eos=True),
                           prefixes=[s.response_ids for s in head])
    tol = numerics.hf_logprob_tolerance(model, [s.prompt_ids for s in whole], [s.response_ids for s in whole])
    for w, h, t in zip(whole, head, tail):
        assert t.prompt_ids == h.prompt_ids and len(t.response_ids) == 6
        joined = extend(h, t, tok)
        assert joined.response_ids == w.response_ids
        numerics.assert_logprobs_within(joined.sampler_logprobs, w.sampler_logprobs, tol, "partial/continued")
        assert joined.token_versions == [0] * 10 and joined.metadata["segments"] == 2


def test_a_continued_prefix_counts_against_a_response_scoped_budget(model, tok):
    """scope=response: the prefix is response, so a 10-token prefix (>= B + W = 6) is cut at the first decode step;
    counted as prompt (the prompt is never a candidate) it would not be before 6 new tokens."""
    c = CompressionConfig(method="rkv", budget=4, window=2, buffer=2, scope="response")
    engine = _engine(model, tok, compression=c)
    prefix = engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=10, ignore_eos=True, seed=3),
                             compression=CompressionConfig())[0]
    part = engine.generate([prefix.prompt_ids], 1, SamplingParams(max_new_tokens=2, ignore_eos=True, seed=4),
                           prefixes=[prefix.response_ids])[0]
    assert part.compression.events == 1
    assert part.compression.peak_kv_tokens == len(prefix.prompt_ids) + 10 + 1   # prefill, then its first token


def test_a_stop_string_may_span_the_prefix(tok):
    ids = tok("Hence x = 5 ##", add_special_tokens=False)["input_ids"]
    checker = StopChecker(eos_ids=[], stop=["x = 5 ##"], ignore_eos=False, max_new_tokens=50, tokenizer=tok)
    assert checker.check(ids[-1:], ids[:-1]) == "stop"
    assert checker.check(ids[-1:]) is None


def _records(count: int) -> list[MathRecord]:
    return [MathRecord(prompt=f"{PROMPTS[i % 3]} {i}", answer=str(i), source_id=f"L{i}", dataset="t")
            for i in range(count)]


def _run_steps(model, tok, partial: PartialRollouts, first: int, last: int, order: list[MathRecord],
               segment: int = 4):
    """Steps ``first``..``last`` of a partial rollout on one engine; the engine serves version step - 1 at step."""
    engine = _engine(model, tok)
    sampling = SamplingParams(max_new_tokens=LIMIT, ignore_eos=True)
    out = []
    with EnginePool.single(engine, ExactReward(), "hf") as pool:
        for step in range(first, last + 1):
            engine.weight_version = step - 1
            batch, metrics = partial.step(pool, lambda k: [order.pop(0) for _ in range(k)], "raw", sampling,
                                          seed=7, step=step)
            out.append((batch, metrics))
    return out


def _partial(staleness: int = 1, segment: int = 4) -> PartialRollouts:
    config = PartialRolloutConfig(enabled=True, extra_groups=2, segment_tokens=segment, max_staleness=staleness)
    return PartialRollouts(config, prompts_per_step=2, n=2)


def test_each_step_trains_whole_groups_with_every_tokens_version(model, tok):
    order = _records(40)
    steps = _run_steps(model, tok, _partial(), 1, 3, order)
    seen: set[int] = set()
    for step, (batch, metrics) in enumerate(steps, start=1):
        groups = sorted({s.group_id for s in batch})
        assert len(groups) == 2 and len(batch) == 4 and not seen & set(groups)
        seen |= set(groups)
        for s in batch:
            assert is_finished(s, LIMIT) and s.reward is not None and len(s.sampler_logprobs) == LIMIT
            assert len(s.versions()) == LIMIT and max(s.versions()) <= step - 1
            assert all(a <= b for a, b in zip(s.versions(), s.versions()[1:]))    # versions only grow along a response
        lags = [step - 1 - v for s in batch for v in s.versions()]
        assert metrics[MN.PARTIAL_STALENESS_MAX] == max(lags) <= 1
        assert metrics[MN.PARTIAL_STALENESS_MEAN] == pytest.approx(sum(lags) / len(lags))
        assert metrics[MN.partial_lag_share(0)] + metrics[MN.partial_lag_share(1)] + \
            metrics[MN.partial_lag_share(2, True)] == pytest.approx(1.0)
    # step 1 starts 4 groups and trains 2 after 3 calls (9 tokens in 4-token calls); the other 2 ran as long: they
    # are finished and wait; step 2 starts 2 more and trains the 2 that waited, sampled under version 0 (lag 1)
    assert steps[0][1][MN.PARTIAL_SEGMENTS] == 3 and steps[0][1][MN.PARTIAL_WAITING_GROUPS] == 2
    assert steps[1][1][MN.partial_lag_share(1)] == 1.0 and steps[1][1][MN.PARTIAL_NEW_GROUPS] == 2


def test_a_response_spanning_versions_keeps_the_sampler_log_prob_of_each_token(model, tok):
    """A 9-token limit in 5-token calls: step 1 trains 2 of its 4 groups (2 calls) and 2 wait; step 2 trains those
    after one call, which gave its 2 new groups 5 tokens under version 1; step 3 finishes them under version 2. Under
    dense sampling each token's sampler log-prob is the dense log-prob of the weights it was sampled under (here the
    same weights: the version is stamped, not moved)."""
    partial = _partial(segment=5)
    steps = _run_steps(model, tok, partial, 1, 3, _records(40))
    assert [m[MN.PARTIAL_SEGMENTS] for _, m in steps] == [2, 1, 1]
    spanning = [s for batch, _ in steps for s in batch if len(set(s.versions())) > 1]
    assert len(spanning) == 4 and all(s.versions() == [1] * 5 + [2] * 4 for s in spanning)
    assert steps[2][1][MN.PARTIAL_CONTINUED_FRAC] == 1.0
    engine = _engine(model, tok)
    for s in spanning:
        dense = engine.dense_logprobs([s.prompt_ids], [s.response_ids])[0]
        tol = numerics.hf_logprob_tolerance(model, [s.prompt_ids], [s.response_ids])
        numerics.assert_logprobs_within(s.sampler_logprobs, dense, tol, "partial/spanning")


class _CallLog(HFRolloutEngine):
    """The reference engine, logging each ``generate`` call's (requests, continued requests)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, int]] = []

    def generate(self, prompts, n, sampling, **kwargs):
        prefixes = kwargs.get("prefixes") or []
        self.calls.append((len(prompts) * n, sum(1 for p in prefixes if len(p))))
        return super().generate(prompts, n, sampling, **kwargs)


def test_a_segment_decodes_new_and_continued_requests_in_one_engine_call(model, tok):
    """12-token responses in 4-token segments (every cap 4): step 3 tops 2 running groups up with 2 new ones, and
    its first segment is one call of 8 requests, 4 of them continued; every segment of the run is one call (an
    engine decodes a segment's requests together, so no call waits for another's tail)."""
    engine = _CallLog(model, tok, show_progress=False)
    partial = PartialRollouts(PartialRolloutConfig(enabled=True, extra_groups=2, segment_tokens=4, max_staleness=2),
                              prompts_per_step=2, n=2)
    order = _records(40)
    segments, firsts = 0, []
    with EnginePool.single(engine, ExactReward(), "hf") as pool:
        for step in (1, 2, 3):
            engine.weight_version = step - 1
            firsts.append(len(engine.calls))
            batch, metrics = partial.step(pool, lambda k: [order.pop(0) for _ in range(k)], "raw",
                                          SamplingParams(max_new_tokens=12, ignore_eos=True), seed=7, step=step)
            segments += int(metrics[MN.PARTIAL_SEGMENTS])
            assert len(batch) == 4 and all(s.response_length == 12 for s in batch)
    assert len(engine.calls) == segments
    assert engine.calls[firsts[2]] == (8, 4), engine.calls


def test_groups_older_than_max_staleness_are_dropped_and_counted(model, tok):
    order = _records(40)
    partial = _partial(staleness=0)
    steps = _run_steps(model, tok, partial, 1, 2, order)
    assert steps[1][1][MN.PARTIAL_DROPPED_GROUPS] == 2 and steps[1][1][MN.PARTIAL_DROPPED_SAMPLES] == 4
    assert all(v == 1 for s in steps[1][0] for v in s.versions())      # trained at lag 0 only


def test_the_samples_in_flight_round_trip_through_a_checkpoint_state(model, tok):
    """Steps 1-3 uninterrupted = steps 1-2, the state through JSON into a new object, then step 3."""
    whole = _run_steps(model, tok, _partial(), 1, 3, _records(40))
    order = _records(40)
    first = _partial()
    _run_steps(model, tok, first, 1, 2, order)
    resumed = _partial()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    (batch, metrics), = _run_steps(model, tok, resumed, 3, 3, order)
    want_batch, want_metrics = whole[2]
    assert [s.to_dict() for s in batch] == [s.to_dict() for s in want_batch]
    assert {k: v for k, v in metrics.items() if not k.startswith("time/") and "per_s" not in k} == \
        {k: v for k, v in want_metrics.items() if not k.startswith("time/") and "per_s" not in k}
