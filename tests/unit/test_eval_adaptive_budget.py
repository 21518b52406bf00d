"""Held-out evaluation during an adaptive-budget run (issue 27): the ``sparse`` mode samples at its stated budget
(``eval.compression``, else ``rollout.compression.budget``, the controller's start), whatever budget the controller
has reached, so evaluations at different steps compare; the opt-in ``adaptive`` mode samples at the controller's
current budget. Each compressed mode logs the budget it used (``eval/<mode>/budget``)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.utils.config_io import ConfigError, from_dict, to_dict
from model_fixtures import cache_sensitive_modchain_model

START, MOVED = 4, 8
"""The configured (start) budget and a budget the controller has moved to."""
ROLLOUT = {"method": "rkv", "budget": START, "window": 2, "buffer": 2}
ADAPTIVE = {"enabled": True, "min_budget": 3, "max_budget": 16, "granule": 1}
STEP = 5


def _cfg(run_dir: Path, model_dir: Path | str = "tiny", **eval_section) -> TrainConfig:
    return from_dict(TrainConfig, {
        "model_path": str(model_dir), "run_dir": str(run_dir), "warm_start": {}, "data": {"dataset": "task:modchain"},
        "rollout": {"sampling": {"max_new_tokens": 12}, "compression": ROLLOUT, "adaptive_budget": ADAPTIVE},
        "eval": {"limit": 3, "max_new_tokens": 12, "modes": ["dense", "sparse", "adaptive"], **eval_section}})


def test_each_mode_has_its_stated_compression(tmp_path):
    from sparse_rl_megatron.trainer.evaluation import mode_compression, modes

    cfg = _cfg(tmp_path)
    assert mode_compression(cfg, "dense", MOVED).is_dense
    assert mode_compression(cfg, "sparse", MOVED) == CompressionConfig(**ROLLOUT)   # the start, not MOVED
    assert mode_compression(cfg, "adaptive", MOVED) == CompressionConfig(**{**ROLLOUT, "budget": MOVED})
    stated = CompressionConfig(method="snapkv", budget=6, window=1, buffer=3)
    cfg = _cfg(tmp_path, compression=to_dict(stated))
    assert mode_compression(cfg, "sparse", MOVED) == stated
    assert mode_compression(cfg, "adaptive", MOVED) == CompressionConfig(**{**ROLLOUT, "budget": MOVED})
    assert modes(cfg, MOVED) == ["dense", "sparse", "adaptive"]
    assert modes(cfg, None) == ["dense", "sparse"]   # a saved model, outside its run: no controller


def test_adaptive_mode_needs_the_controller_and_sglang_eval_must_fit_the_servers(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.modes has 'adaptive' .* rollout.adaptive_budget.enabled is false"):
        from_dict(TrainConfig, {"rollout": {"compression": ROLLOUT}, "eval": {"modes": ["adaptive"]}})
    sglang = {"engine": "sglang", "compression": ROLLOUT, "adaptive_budget": ADAPTIVE}
    from_dict(TrainConfig, {"rollout": sglang, "eval": {"compression": {**ROLLOUT, "budget": 16}}})  # B + W = max's
    with pytest.raises(ConfigError, match=r"eval.compression \(rkv B=17 .*\) does not fit the sglang servers' "
                                          r"\(rkv B=16 "):
        from_dict(TrainConfig, {"rollout": sglang, "eval": {"compression": {**ROLLOUT, "budget": 17}}})


def test_run_evaluates_with_the_controllers_current_budget(tmp_path, monkeypatch):
    """``Run.evaluate`` hands the controller's budget to the evaluation (for ``adaptive`` only)."""
    from sparse_rl_megatron.compression.budget_controller import AdaptiveBudgetConfig, BudgetController
    from sparse_rl_megatron.trainer import run as run_module
    from sparse_rl_megatron.trainer.run import Run
    from sparse_rl_megatron.trainer.runtime.device_turns import DeviceTurns

    seen = {}
    monkeypatch.setattr(run_module, "evaluate_pool", lambda *args, **kwargs: seen.update(kwargs) or {})
    controller = BudgetController(AdaptiveBudgetConfig(**ADAPTIVE, gain=2.0, deadband=0.0), START)
    controller.update(1.0)   # far above the target: the budget grows
    assert controller.budget > START
    unused = dict.fromkeys(("console", "learner", "ref_learner", "pool", "probe", "heartbeat", "stop",
                            "prompts"))  # parts of a run this method does not touch
    run = Run(cfg=_cfg(tmp_path), plan=SimpleNamespace(eval_data={"x": None}, template="t"), run_dir=tmp_path,
              budget_controller=controller, turns=DeviceTurns(None), **unused)
    run.evaluate(STEP)
    assert seen == {"controller_budget": controller.budget}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return cache_sensitive_modchain_model(tmp_path_factory.mktemp("adaptive_eval") / "model")


def _evaluate(cfg: TrainConfig, model_dir: Path, work: Path, controller_budget: int | None) -> dict:
    from sparse_rl_megatron.rollout.engine_registry import ENGINES
    from sparse_rl_megatron.trainer.engine_pool.pool import EnginePool
    from sparse_rl_megatron.trainer.evaluation import evaluate_pool
    from sparse_rl_megatron.trainer.run import make_reward
    from sparse_rl_megatron.trainer.run_plan import preflight

    plan = preflight(cfg, 1, lengths=("eval",))
    engine = ENGINES.get(cfg.rollout.engine).build(cfg.rollout.engine_build(str(model_dir)))
    with make_reward(cfg, plan) as reward:
        with EnginePool.single(engine, reward, cfg.rollout.engine) as pool:
            return evaluate_pool(pool, plan.eval_data, cfg, plan.template, STEP, work,
                                 controller_budget=controller_budget)


def _record(work: Path, mode: str) -> dict:
    data = json.loads((work / "eval" / f"step_{STEP}.{mode}.json").read_text())
    return {"compression": data["compression"],
            "responses": [x["response"] for b in data["benchmarks"].values() for p in b["problems"]
                          for x in p["samples"]]}


def test_sparse_evaluation_keeps_the_stated_budget_while_the_controller_moves(model_dir, tmp_path):
    cfg = _cfg(tmp_path, model_dir)
    moved = _evaluate(cfg, model_dir, tmp_path / "moved", MOVED)
    alone = _evaluate(cfg, model_dir, tmp_path / "alone", None)   # no controller at all
    assert moved["eval/sparse/budget"] == alone["eval/sparse/budget"] == START
    assert moved["eval/adaptive/budget"] == MOVED and "eval/adaptive/accuracy" not in alone
    assert "eval/dense/budget" not in moved
    sparse, adaptive = _record(tmp_path / "moved", "sparse"), _record(tmp_path / "moved", "adaptive")
    assert sparse == _record(tmp_path / "alone", "sparse")   # the controller's budget does not reach it
    assert sparse["compression"] == CompressionConfig(**ROLLOUT).describe()
    assert adaptive["compression"] == CompressionConfig(**{**ROLLOUT, "budget": MOVED}).describe()
    assert adaptive["responses"] != sparse["responses"]   # the budgets matter here: a swap would show
