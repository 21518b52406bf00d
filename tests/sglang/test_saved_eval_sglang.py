"""``evaluate_saved`` on the SGLang CPU engine: one engine serves two caches (each request carries its own: every
sample's length, compression events and peak KV are the HF engine's under that cache, not the server's), and its
real ``shutdown`` runs once."""
from __future__ import annotations

import json

from sglang_helpers import STRICT_MEMORY_CHECKS

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.experiment.saved_eval import evaluate_saved

SERVER = {"method": "rkv", "budget": 10, "window": 2, "buffer": 4}
CACHES = [CompressionConfig(method="rkv", budget=4, window=2, buffer=2),
          CompressionConfig(method="snapkv", budget=6, window=1, buffer=4)]


def _shapes(work) -> list[tuple]:
    record = json.loads((work / "eval" / "step_1.sparse.json").read_text())
    return [(x["response_tokens"], x["compression_events"], x["peak_kv_tokens"])
            for p in record["benchmarks"]["task:modchain"]["problems"] for x in p["samples"]]


def test_one_sglang_engine_evaluates_each_cache_and_is_shut_down_once(tmp_path, monkeypatch):
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine
    from sparse_rl_megatron.tasks import get_task
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.utils.config_io import from_dict, to_dict

    for key, value in STRICT_MEMORY_CHECKS.items():
        monkeypatch.setenv(key, value)
    real, calls = SGLangRolloutEngine.shutdown, []

    def spy(self):
        calls.append(self)
        real(self)

    monkeypatch.setattr(SGLangRolloutEngine, "shutdown", spy)
    model = get_task("task:modchain").build_model(tmp_path / "model", seed=0)
    cfg = from_dict(TrainConfig, {
        "model_path": str(model), "run_dir": str(tmp_path), "warm_start": {}, "data": {"dataset": "task:modchain"},
        "eval": {"limit": 2, "max_new_tokens": 16, "modes": ["sparse"]},
        "rollout": {"engine": "sglang", "compression": SERVER, "sglang": {"max_total_tokens": 1024}}})
    works = [tmp_path / str(i) for i in range(len(CACHES))]
    evaluate_saved(cfg, model, 1, list(zip(CACHES, works)))
    assert len(calls) == 1
    hf_cfg = from_dict(TrainConfig, {**to_dict(cfg), "rollout": {"compression": SERVER}})
    hf_works = [tmp_path / f"hf_{i}" for i in range(len(CACHES))]
    evaluate_saved(hf_cfg, model, 1, list(zip(CACHES, hf_works)))
    shapes = [_shapes(w) for w in works]
    assert shapes == [_shapes(w) for w in hf_works] and shapes[0] != shapes[1]
