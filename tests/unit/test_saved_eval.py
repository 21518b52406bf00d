"""``evaluate_saved``: one engine serves a saved model's evaluations under several KV caches exactly as a fresh
engine per cache did, and it is shut down once at the end, also when an evaluation fails."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.experiment.saved_eval import evaluate_saved
from model_fixtures import cache_sensitive_modchain_model

CACHES = [CompressionConfig(method="rkv", budget=4, window=2, buffer=2),
          CompressionConfig(method="snapkv", budget=3, window=1, buffer=3)]
STEP = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return cache_sensitive_modchain_model(tmp_path_factory.mktemp("saved") / "model")


def _cfg(model_dir: Path, run_dir: Path):
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.utils.config_io import from_dict

    return from_dict(TrainConfig, {"model_path": str(model_dir), "run_dir": str(run_dir), "warm_start": {},
                                   "data": {"dataset": "task:modchain"},
                                   # within the tiny model's 256-token context (preflight checks the rollout too)
                                   "rollout": {"sampling": {"max_new_tokens": 12}},
                                   "eval": {"limit": 3, "max_new_tokens": 12, "modes": ["dense", "sparse"]}})


def _fresh_engine_per_cache(cfg, model_dir: Path, works: list[Path]) -> list[dict]:
    """What the study did before: preflight, an engine and a reward for every cache."""
    import dataclasses

    from sparse_rl_megatron.rollout.engine_registry import ENGINES
    from sparse_rl_megatron.trainer.evaluation import evaluate
    from sparse_rl_megatron.trainer.run_plan import preflight
    from sparse_rl_megatron.trainer.run import make_reward

    results = []
    for cache, work in zip(CACHES, works):
        ecfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, compression=cache))
        plan = preflight(ecfg, 1, lengths=("eval",))
        spec = ENGINES.get(ecfg.rollout.engine)
        engine = spec.build(ecfg.rollout.engine_build(str(model_dir)))
        with make_reward(ecfg, plan) as reward:
            results.append(evaluate(engine, reward, plan.eval_data, ecfg, plan.template, STEP, work))
    return results


def _untimed(data):
    """``data`` without its wall-clock times (``time/eval_s``, ``seconds``)."""
    if isinstance(data, dict):
        return {k: _untimed(v) for k, v in data.items() if k not in ("time/eval_s", "seconds")}
    if isinstance(data, list):
        return [_untimed(v) for v in data]
    return data


def _records(work: Path) -> dict:
    return {mode: _untimed(json.loads((work / "eval" / f"step_{STEP}.{mode}.json").read_text()))
            for mode in ("dense", "sparse")}


def test_one_engine_evaluates_every_cache_as_a_fresh_engine_per_cache_does(model_dir, tmp_path):
    cfg = _cfg(model_dir, tmp_path)
    fresh = [tmp_path / "fresh" / str(i) for i in range(len(CACHES))]
    shared = [tmp_path / "shared" / str(i) for i in range(len(CACHES))]
    expected = _fresh_engine_per_cache(cfg, model_dir, fresh)
    got = evaluate_saved(cfg, model_dir, STEP, list(zip(CACHES, shared)))
    assert [_untimed(m) for m in got] == [_untimed(m) for m in expected]
    assert [_records(w) for w in shared] == [_records(w) for w in fresh]  # every sample, number for number
    sparse = [_records(w)["sparse"] for w in shared]
    assert [s["compression"] for s in sparse] == [c.describe() for c in CACHES]
    responses = [[x["response"] for p in s["benchmarks"]["task:modchain"]["problems"] for x in p["samples"]]
                 for s in sparse]
    assert responses[0] != responses[1]  # the caches matter here: evaluating under the wrong one would show


def test_none_keeps_the_configs_own_evaluation(model_dir, tmp_path):
    import dataclasses

    cfg = _cfg(model_dir, tmp_path)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, compression=CACHES[1]))
    got, = evaluate_saved(cfg, model_dir, STEP, [(None, tmp_path / "own")])
    assert "eval/dense/accuracy" in got and "eval/sparse/accuracy" in got
    assert _records(tmp_path / "own")["sparse"]["compression"] == CACHES[1].describe()


@pytest.fixture
def shutdowns(monkeypatch) -> list:
    """Every ``shutdown`` of an HF engine (it has none of its own: one is spied in, as an engine with child
    processes has; ``evaluate_saved`` must call it as ``EnginePool.start`` calls SGLang's)."""
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    calls = []
    monkeypatch.setattr(HFRolloutEngine, "shutdown", lambda self: calls.append(self), raising=False)
    return calls


def test_the_engine_is_shut_down_once_after_the_evaluations(model_dir, tmp_path, shutdowns):
    cfg = _cfg(model_dir, tmp_path)
    evaluate_saved(cfg, model_dir, STEP, [(c, tmp_path / str(i)) for i, c in enumerate(CACHES)])
    assert len(shutdowns) == 1


def test_the_engine_is_shut_down_when_an_evaluation_fails(model_dir, tmp_path, shutdowns):
    cfg = _cfg(model_dir, tmp_path)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the evaluation's directory goes")
    with pytest.raises(OSError):
        evaluate_saved(cfg, model_dir, STEP, [(CACHES[0], tmp_path / "ok"), (CACHES[1], blocked)])
    assert len(shutdowns) == 1
    assert (tmp_path / "ok" / "eval" / f"step_{STEP}.sparse.json").is_file()  # the first cache was evaluated
