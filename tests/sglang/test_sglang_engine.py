"""SGLangRolloutEngine on SGLang's CPU engine with the sparse_kv plugin, against the HF reference engine.

One in-process engine for the module (radix cache on, strict idle and busy memory checks on), server
compression rkv with B = 12, alpha = 3, W = 4; other methods and scopes are per-request overrides.
Oracle: ``HFRolloutEngine.teacher_forced`` replays the tokens SGLang sampled with the same compressor.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from sglang_helpers import (assert_logprobs_match, assert_matches_reference, full_forward_logprobs, read_stats,
                            scheduler_env, teacher_forced)

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import RolloutEngine, SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

SERVER = CompressionConfig(method="rkv", budget=12, window=3, buffer=4)
# Mixed lengths; the last is longer than B + W, so with scope all its first compression copies kept
# prompt tokens out of the radix tree into the request's own slots.
PROMPTS = [[5, 17, 42], [300, 12, 8, 77, 41, 9, 250, 33, 6], list(range(100, 121))]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    stats = tmp_path_factory.mktemp("stats") / "pool.jsonl"
    config = SGLangEngineConfig(model_path=str(tiny_model_dir), compression=SERVER, dtype="float32",
                                max_total_tokens=2048, kept_digest=True, stats_path=str(stats), count_host_syncs=True)
    with scheduler_env():
        eng = SGLangRolloutEngine(config)
    yield eng
    eng.shutdown()


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine) and engine.tokenizer is not None


def test_budget_at_least_length_matches_full_forward(engine, hf_model):
    # prompt + response stay below B + W = 16: no event, so the plugin must be exactly dense
    samples = engine.generate(PROMPTS[:2], 2, SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True))
    for s in samples:
        assert s.compression.events == 0 and s.compression.kept_digest is None
        assert (s.compression.method, s.compression.budget) == ("rkv", 12)
        ref = full_forward_logprobs(hf_model, s.prompt_ids, s.response_ids)
        assert_logprobs_match(s.sampler_logprobs, ref, hf_model, s.prompt_ids, s.response_ids, "no_event_vs_forward")


def test_dense_logprobs_score_every_vocabulary_id_the_last_included(engine, hf_model):
    # SGLang reports ids >= vocab - 1 as 0 in input_token_logprobs; the values are still those ids' (found when a
    # geometric-workload benchmark sampled the tiny model's last id, which is one of its EOS ids there)
    last = hf_model.config.vocab_size - 1
    prompt, response = PROMPTS[1], [7, last, 19, last - 1, last]
    got = engine.dense_logprobs([prompt], [response])[0]
    ref = full_forward_logprobs(hf_model, prompt, response)
    assert_logprobs_match(got, ref, hf_model, prompt, response, "dense_logprobs_last_id")


@pytest.mark.parametrize("method", ["rkv", "snapkv", "streamingllm"])
@pytest.mark.parametrize("scope", ["all", "response"])
def test_small_budget_matches_teacher_forced_reference(engine, hf_model, method, scope):
    config = CompressionConfig(method=method, budget=12, window=3, buffer=4, scope=scope, sink_tokens=2)
    samples = engine.generate(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=28, seed=1),
                              compression=config)
    assert [(s.group_id, s.index_in_group) for s in samples] == [(g, i) for g in range(3) for i in range(4)]
    assert max(s.compression.events for s in samples) >= 3
    assert all(s.compression.scope == scope and s.compression.method == method for s in samples)
    assert_matches_reference(samples, teacher_forced(hf_model, config, samples), hf_model)


def test_retained_kv_read_from_the_pool_stays_within_budget(engine):
    """Every forward logged the pool from SGLang's allocator and rows: what requests own adds up with the
    radix tree to what the allocator handed out, and past its (shared) prompt no request ever owns more
    than B + W slots."""
    lines = [x for x in read_stats(Path(engine.config.stats_path)) if x.get("decode")]
    assert len(lines) > 100
    limit = SERVER.max_candidates
    for x in lines:
        assert x["used"] == x["tree"] + sum(x["owned"]), x
        assert max(x["owned_response"]) <= limit, x
    assert max(max(x["owned_response"]) for x in lines) == limit and any(x["compressing"] for x in lines)
    # the GRPO groups' prompts were shared: at some step the tree held them while their samples decoded
    assert any(x["tree"] >= len(PROMPTS[2]) and max(x["owned"]) <= limit for x in lines)


def test_plugin_memory_was_reserved_before_the_kv_pool(engine):
    """SGLang's scheduler sized its KV pool after the plugin took its bytes out of the budget (for the most rows
    the pool may get), then the backend allocated exactly the formula for the rows it got."""
    (line,) = [x["memory"] for x in read_stats(Path(engine.config.stats_path)) if "memory" in x]
    assert line["allocated"] == line["formula"] > 0
    assert line["reserved"] is not None and line["reserved_rows"] >= line["rows"]
    assert line["reserved"] >= line["allocated"]


def test_host_syncs_per_forward(engine):
    """The plugin's hooks cost what ``test_host_syncs`` counts in-process, here in SGLang's scheduler (rows from
    the batch build, overlap scheduler, radix tree, scheduler-side hooks between forwards)."""
    lines = [x for x in read_stats(Path(engine.config.stats_path)) if x.get("decode")]
    assert all(x["host_rows"] for x in lines)
    quiet = [x["host_syncs"] for x in lines if not x["compressing"]]
    busy = [x["host_syncs"] for x in lines if x["compressing"]]
    print(f"host syncs per decode forward: no compression max {max(quiet)}, compressing max {max(busy)}")
    assert max(quiet) == 0 and max(busy) <= 1   # the kept digests: one copy per compressing step


def _wait_idle_line(path, since: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle = [x for x in read_stats(path)[since:] if x.get("idle")]
        if idle and idle[-1]["available"] == idle[-1]["total"]:
            return idle[-1]
        time.sleep(0.2)
    raise AssertionError(f"the pool did not return to fully free: {read_stats(path)[-3:]}")


ROUNDS = 12
"""Each prompt 4 times: a slot lost or double-freed per round shows in the first round's idle line already (the
strict checkers stay on); the packed-pool soak (test_soak_plugin.py) covers slot reuse under pressure."""


def test_repeated_rounds_leave_the_allocator_where_it_started(engine):
    path = Path(engine.config.stats_path)
    config = CompressionConfig(method="snapkv", budget=12, window=3, buffer=4, scope="all")
    for round_ in range(ROUNDS):
        mark = len(read_stats(path))
        samples = engine.generate(PROMPTS[round_ % 3:round_ % 3 + 1], 3,
                                  SamplingParams(temperature=1.0, max_new_tokens=20, seed=round_),
                                  compression=config)
        assert len(samples) == 3
        engine.client.flush_cache()  # drop the radix tree's prompts: every slot must be free again
        idle = _wait_idle_line(path, mark)
        assert not idle["leak"] and idle["evictable"] == 0 and idle["protected"] == 0


def test_weight_updates_tensor_distributed_disk(engine, hf_model, tmp_path):
    from sparse_rl_megatron.models.tiny import build_tiny_model

    other = build_tiny_model(seed=11, init_std=0.2)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=2)
    for version, (sync, model) in enumerate([("tensor", other), ("distributed", hf_model), ("disk", other)], 1):
        engine.config.weight_sync, engine.config.weight_sync_dir = sync, str(tmp_path)
        named = list(model.state_dict().items())
        engine.update_weights([named[:5], named[5:]], version=version)   # two buckets, like the learner's export
        # same prompts as before: a radix cache still holding old-weight KV would fail the comparison
        samples = engine.generate(PROMPTS, 2, sampling)
        assert all(s.weight_version == version for s in samples)
        assert_matches_reference(samples, teacher_forced(model, SERVER, samples), model)
    engine.config.weight_sync = "tensor"
    engine.update_weights(hf_model.state_dict().items(), version=4)


def test_a_sample_never_claims_weights_it_was_not_sampled_with(engine, tiny_model_dir):
    engine.client.call_each("update_weights_from_disk", [{"model_path": str(tiny_model_dir), "weight_version": "99"}])
    with pytest.raises(RuntimeError, match="sampled with weight version 99"):
        engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4))
    engine.update_weights_from_disk(str(tiny_model_dir), version=5)
    assert engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4))[0].weight_version == 5


def test_release_and_resume_memory(engine, hf_model):
    engine.release_memory()
    with pytest.raises(RuntimeError, match="after release_memory"):
        engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4))
    engine.resume_memory()
    assert len(engine.generate(PROMPTS[:1], 2, SamplingParams(max_new_tokens=4))) == 2
    # by part, as the trainer's turns take them (SGLang's tags): the weights back for a push, the KV pool after
    engine.release_memory()
    engine.release_memory(["kv_cache"])  # already released: skipped (SGLang would pause it twice)
    engine.resume_memory(["weights"])
    with pytest.raises(RuntimeError, match="generate called after release_memory\\(\\) with kv_cache still released"):
        engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4))
    version = engine.weight_version + 1
    engine.update_weights(list(hf_model.state_dict().items()), version=version)
    engine.resume_memory(["kv_cache"])
    assert engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4))[0].weight_version == version
    with pytest.raises(ValueError, match="memory parts \\['cuda_graph'\\]; valid: weights, kv_cache"):
        engine.release_memory(["cuda_graph"])


def test_a_bucket_serialized_for_the_engine_leaves_the_learners_storage_private():
    """Pickling a CPU tensor for another process moves its storage into shared memory in place; the payload is a
    copy, so a learner parameter exported as itself stays resizable (``learner.offload`` can put it to sleep)."""
    import torch

    from sparse_rl_megatron.rollout.sglang_weights import serialize_bucket

    weight = torch.randn(4, 8)
    assert serialize_bucket([("w", weight)]) and not weight.untyped_storage().is_shared()


def test_bad_request_settings_are_refused_with_the_field(engine):
    with pytest.raises(ValueError, match="window .4. exceeds the server's window .3."):
        engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4),
                        compression=CompressionConfig(method="rkv", budget=12, window=4, buffer=4))
    # the engine keeps serving
    assert len(engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4))) == 1


def test_mixed_budgets_in_one_call_match_the_reference_per_budget(engine, hf_model):
    """Per-request budgets (the adaptive budget, issue 27): the requests of one call, each with its prompt's budget
    (at most the server's), decode side by side; each matches the HF engine's replay at its own budget."""
    budgets = [6, 12, 8]
    samples = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=28, seed=3),
                              budgets=budgets)
    assert [(s.group_id, s.index_in_group) for s in samples] == [(g, i) for g in range(3) for i in range(2)]
    for g, b in enumerate(budgets):
        mine = [s for s in samples if s.group_id == g]
        assert all(s.compression.budget == b and s.compression.events >= 1 for s in mine)
        at_b = CompressionConfig(**{**SERVER.__dict__, "budget": b})
        assert_matches_reference(mine, teacher_forced(hf_model, at_b, mine), hf_model)
    with pytest.raises(ValueError, match=r"budget 16 \+ buffer 4 exceeds the server's B \+ W \(16\)"):
        engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4), budgets=[16])


LONG = 400
"""Response tokens of the request left running across a weight update: seconds of decoding, far longer than the
short flush timeout below."""


def _leave_a_request_running(engine, stats: Path):
    """Submit a long request and return (its task on the engine's loop, its rid) once the scheduler decodes it: it
    stays queued/running in the scheduler while the caller goes on (its answer is awaited later)."""
    import asyncio

    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_helpers import FAULT_BOUND_S

    tm = engine.client.engine.tokenizer_manager
    rid = f"held-{time.monotonic_ns()}"
    obj = GenerateReqInput(input_ids=[7, 8, 9], rid=rid,
                           sampling_params={"max_new_tokens": LONG, "ignore_eos": True, "temperature": 1.0})
    mark = len(read_stats(stats))

    async def answer():   # to its end: the generator holds SGLang's model-update reader lock until it is exhausted
        return [out async for out in tm.generate_request(obj, None)][-1]

    async def start():
        task = asyncio.ensure_future(answer())
        deadline = time.monotonic() + FAULT_BOUND_S
        while not any(x.get("decode") for x in read_stats(stats)[mark:]):   # the scheduler decodes it
            assert not task.done() and time.monotonic() < deadline, "the held request never decoded"
            await asyncio.sleep(0.02)
        return task

    return engine.client._wait(start()), rid


def test_a_weight_update_waits_for_the_engine_to_go_idle_before_it_flushes(engine, hf_model, monkeypatch):
    """Issue 41: SGLang flushes its radix cache only when the engine is idle. A request is left running in the scheduler
    between the weight push and the flush (another client's, or one whose abort is not processed yet). The update
    waits until it ends and then flushes: the next samples of prompts the tree held under the old weights match the
    new weights. With a flush timeout shorter than the request the update fails in one line, and so does sampling,
    until a flush succeeds (here once the request is aborted). Before issue 41 the refused flush went unnoticed and the
    next samples reused the old weights' prompt KV (off by far more than the tolerance)."""
    import asyncio

    from sparse_rl_megatron.models.tiny import build_tiny_model

    stats = Path(engine.config.stats_path)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=4)
    engine.generate(PROMPTS, 1, sampling)          # the prompts go into the tree, computed with the current weights
    push, held = engine.weights.push, {}

    def push_then_leave_a_request_running(*args, **kwargs):
        push(*args, **kwargs)
        held["task"], held["rid"] = _leave_a_request_running(engine, stats)

    monkeypatch.setattr(engine.weights, "push", push_then_leave_a_request_running)
    other = build_tiny_model(seed=12, init_std=0.2)
    version = engine.weight_version + 1
    engine.update_weights(other.state_dict().items(), version=version)
    assert held["task"].done(), "the update returned before the request it waited for ended"
    samples = engine.generate(PROMPTS, 1, sampling)
    assert_matches_reference(samples, teacher_forced(other, SERVER, samples), other)

    from sparse_rl_megatron.rollout.sglang_client import CacheNotFlushed

    monkeypatch.setattr(engine.config, "flush_timeout_s", 0.05)
    with pytest.raises(CacheNotFlushed) as err:
        engine.update_weights(hf_model.state_dict().items(), version=version + 1)
    assert str(err.value).startswith(f"weight version {version + 1}: the in-process SGLang engine did not flush its "
                                     "radix cache within 0.05 s") and "\n" not in str(err.value), err.value
    with pytest.raises(CacheNotFlushed):
        engine.generate(PROMPTS, 1, sampling)      # nothing is sampled on the stale tree
    engine.client.engine.tokenizer_manager.abort_request(rid=held["rid"])
    engine.client._wait(asyncio.wait_for(held["task"], FAULT_BOUND_S_ENGINE))
    monkeypatch.undo()                             # the default timeout: the abort is processed, the flush goes
    samples = engine.generate(PROMPTS, 1, sampling)
    assert all(s.weight_version == version + 1 for s in samples)
    assert_matches_reference(samples, teacher_forced(hf_model, SERVER, samples), hf_model)


FAULT_BOUND_S_ENGINE = 120.0
"""Bound on waiting for the aborted held request's answer (it comes within a scheduler step)."""


def test_a_continued_response_matches_the_reference_given_the_same_prefix(engine, hf_model):
    """``rollout.partial``'s continuation on the plugin (scope all): prompt + the response so far is prefilled, then
    decoded under compression, as the reference engine's replay of prompt + prefix: the same log-probs, events, peak
    and kept sets; the samples hold the new tokens and the prompt alone. ``scope: response`` is refused in one line."""
    import dataclasses

    from sglang_helpers import assert_matches_reference

    config = CompressionConfig(method="rkv", budget=12, window=3, buffer=4, scope="all")
    head = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, seed=2, ignore_eos=True), compression=config)
    tail = engine.generate([s.prompt_ids for s in head], 1, SamplingParams(max_new_tokens=14, seed=3, ignore_eos=True),
                           compression=config, group_ids=list(range(len(head))),
                           prefixes=[s.response_ids for s in head])
    assert all(t.prompt_ids == h.prompt_ids and t.response_length == 14 for t, h in zip(tail, head))
    assert min(t.compression.events for t in tail) >= 2
    as_prompts = [dataclasses.replace(t, prompt_ids=h.prompt_ids + h.response_ids) for t, h in zip(tail, head)]
    assert_matches_reference(as_prompts, teacher_forced(hf_model, config, as_prompts), hf_model)
    with pytest.raises(ValueError, match=r"prefixes .* need compression.scope: all on the sglang engine"):
        engine.generate([head[0].prompt_ids], 1, SamplingParams(max_new_tokens=4), prefixes=[head[0].response_ids],
                        compression=dataclasses.replace(config, scope="response"))
