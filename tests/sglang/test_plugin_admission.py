"""Admission by each request's own bound (issue 27): a compressed request reserves its own B + W + 1 future tokens,
not the server's, so in one KV pool more requests run at once at a smaller per-request budget, and they still
match the HF reference engine's replay at their budget.

The server is sized for B_max = 28 (the adaptive budget's ``max_budget``); the same 16 requests (4 prompts x n = 4,
48 EOS-ignoring tokens, radix cache off so that SGLang's admission arithmetic is the whole story) run at B = 28
and at B = 8 in a pool of ``POOL`` tokens. Each admitted request reserves its prompt plus its bound, so at most
``POOL // (prompt + bound)`` rows decode together: ~5 at B = 28 (bound 33), ~11 at B = 8 (bound 13). Before the
per-request bound both budgets reserved the server's 33 and ran equally few rows.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_helpers import assert_matches_reference, read_stats, scheduler_env, teacher_forced

from sglang_ext.admission import request_bound
from sglang_ext.config import SparseKVConfig
from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams

SERVER = CompressionConfig(method="rkv", budget=28, window=3, buffer=4)
SMALL = 8
POOL = 200
PROMPTS = [[5, 17, 42, 8], [300, 12, 8, 77], [41, 9, 250, 33], [6, 7, 100, 101]]
N = 4
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True)


def _bound(budget: int) -> int:
    return budget + SERVER.buffer + 1


def test_a_request_is_bounded_by_its_own_compression():
    backend = SimpleNamespace(compresses=True, sglang_clip=4096, config=SparseKVConfig(compression=SERVER))
    req = lambda overrides: SimpleNamespace(sampling_params=SimpleNamespace(  # noqa: E731
        custom_params=None if overrides is None else {"sparse_kv": overrides}))
    assert request_bound(backend, req(None)) == _bound(28) == 33          # the server's compression
    assert request_bound(backend, req({"budget": SMALL})) == _bound(SMALL) == 13
    assert request_bound(backend, req({"method": "none"})) == 4096          # dense: it grows to max_new_tokens
    assert request_bound(backend, req({"budget": 40})) == 4096              # refused when bound: no guess
    assert request_bound(SimpleNamespace(**{**vars(backend), "compresses": False}), req(None)) == 4096
    cached = req({"budget": SMALL})
    request_bound(backend, cached)
    cached.sampling_params.custom_params = None
    assert request_bound(backend, cached) == 13                            # computed once per request


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    stats = tmp_path_factory.mktemp("stats") / "pool.jsonl"
    config = SGLangEngineConfig(model_path=str(tiny_model_dir), compression=SERVER, dtype="float32",
                                max_total_tokens=POOL, radix_cache=False, kept_digest=True, stats_path=str(stats))
    with scheduler_env():
        eng = SGLangRolloutEngine(config)
    yield eng
    eng.shutdown()


def _run(engine, budget: int):
    """The 16 requests at ``budget``: their samples, and the most rows one decode forward ran."""
    path = Path(engine.config.stats_path)
    before = len(read_stats(path))
    samples = engine.generate(PROMPTS, N, SAMPLING, budgets=[budget] * len(PROMPTS))
    decodes = [x for x in read_stats(path)[before:] if x.get("decode")]
    return samples, max(x["running"] for x in decodes)


def test_a_smaller_budget_admits_more_rows_and_matches_the_reference(engine, hf_model):
    rows = {}
    for budget in (SERVER.budget, SMALL):
        samples, rows[budget] = _run(engine, budget)
        assert all(s.compression.budget == budget and s.compression.events >= 1 for s in samples)
        assert all(s.metadata.get("retractions", 0) == 0 for s in samples)
        assert_matches_reference(samples, teacher_forced(hf_model, CompressionConfig(
            **{**SERVER.__dict__, "budget": budget}), samples), hf_model)
    assert engine.resubmitted == 0
    print(f"most rows decoding at once: {rows}")
    # admission's arithmetic: each admitted row reserves its prompt + its own bound out of the pool
    prompt = len(PROMPTS[0])
    assert rows[SERVER.budget] <= POOL // (prompt + _bound(SERVER.budget))
    assert rows[SMALL] > POOL // (prompt + _bound(SERVER.budget)), rows   # more than the server's bound allows
    assert rows[SMALL] <= POOL // (prompt + _bound(SMALL)), rows
