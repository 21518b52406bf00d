"""The weight-sync probe tells 16-bit noise from wrong weights: a bf16 engine serving an fp32 learner's weights
passes; a stale engine, a garbled bucket and a wrong dtype cast fail in one line naming the engine and its rank.

The learner is an HF model in float32 (its log-probs are what the Megatron learner computes: ``tests/megatron``
checks that parity); the engine is the ``hf`` rollout engine, fed through ``EnginePool.sync`` / ``probe``.
Measured on this model (llama, 4 layers, width 128, init std 0.2; 16-token probe response), mean / max
|log-prob difference| to the learner: bf16 engine 0.060 / 0.17 (the maximum alone fails the former 0.1
tolerance); one shuffled o_proj 0.87 / 2.1; bf16 bits read as fp16 46 / 73; the previous version (weights +
0.1 x init std noise) 1.3 / 4.1.
"""
from __future__ import annotations

import pytest
import torch

from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.trainer.engine_pool.pool import EnginePool
from sparse_rl_megatron.trainer.engine_pool.weight_probe import (PROBE_TOLERANCE_16BIT, PROBE_TOLERANCE_FP32,
                                                             WeightSyncError, default_tolerance, engine_logprobs,
                                                             probe_sequence, probe_verdict)
from sparse_rl_megatron.utils.errors import RunFailed
from sparse_rl_megatron.models.tiny import build_tiny_model

SHAPE = dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2)
STD = 0.2
LABEL = "rollout engine 'hf' #0 on rank 0"
SHUFFLED = "model.layers.1.self_attn.o_proj.weight"


def _model(seed: int = 1):
    return build_tiny_model("llama", init_std=STD, seed=seed, **SHAPE)


class FakeLearner:
    """An fp32 HF model with the learner's two probe-facing calls (``logprobs``, ``export_weights``); ``spoil``
    changes the exported buckets (what a broken export or transport would deliver)."""

    def __init__(self, model, spoil=None):
        self.model, self.spoil = model, spoil
        self.scorer = HFRolloutEngine(model, show_progress=False)

    def logprobs(self, batch):
        return engine_logprobs(self.scorer, batch)

    def export_weights(self, bucket_bytes: int):
        items = [(k, v.detach().clone()) for k, v in self.model.state_dict().items() if k != "lm_head.weight"]
        for name, tensor in items:  # one tensor a bucket
            yield [(name, self.spoil(name, tensor) if self.spoil else tensor)]

    def train(self, scale: float, seed: int = 5) -> None:
        """A stand-in for an optimizer step: every weight moves by ``scale`` x the init std (seeded noise)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(scale * STD * torch.randn(p.shape, generator=gen))


def _pool(dtype: torch.dtype):
    engine = HFRolloutEngine(_model(seed=9), show_progress=False, dtype=dtype)  # other weights until the sync
    return EnginePool.single(engine, None, "hf"), engine


PROBE = probe_sequence(512, 32, seed=0)


def _sync_and_probe(learner, pool, version: int, tolerance: float) -> dict[str, float]:
    pool.sync(learner, version, bucket_mb=1)
    return pool.probe(learner.logprobs(PROBE), PROBE, tolerance, version)


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert isinstance(err.value, RunFailed) and "\n" not in text and text.startswith(f"{LABEL} does not serve")
    return text


def test_default_tolerance_follows_both_dtypes():
    assert default_tolerance("float32") == default_tolerance("float32", torch.float32) == PROBE_TOLERANCE_FP32
    assert default_tolerance("bfloat16") == default_tolerance("float32", torch.bfloat16) == PROBE_TOLERANCE_16BIT
    assert default_tolerance("float16", "float32") == PROBE_TOLERANCE_16BIT


def test_bf16_engine_against_fp32_learner_passes_and_keeps_passing_after_training():
    learner, (pool, _) = FakeLearner(_model()), _pool(torch.bfloat16)
    tol = default_tolerance("bfloat16")
    first = _sync_and_probe(learner, pool, 0, tol)
    # bf16 rounding: mean well inside the tolerance (its derivation: weight_probe.PROBE_TOLERANCE_16BIT)
    assert 0 < first["sync/probe_mean_abs_diff"] < tol / 2
    for version, scale in ((1, 0.1), (2, 1e-4)):  # a step that moves the probe past the tolerance, and a tiny one
        learner.train(scale, seed=version)
        metrics = _sync_and_probe(learner, pool, version, tol)
        assert metrics["sync/probe_mean_abs_diff"] < tol / 2 and metrics["sync/probe_max_abs_diff"] >= \
            metrics["sync/probe_mean_abs_diff"]
    pool.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_engine_fails_naming_the_engine_and_rank(dtype):
    learner, (pool, engine) = FakeLearner(_model()), _pool(dtype)
    tol = default_tolerance(str(dtype).removeprefix("torch."))
    _sync_and_probe(learner, pool, 0, tol)
    learner.train(0.1)  # version 1 is 1.3 apart from version 0 in mean |log-prob| (module docstring)
    # the engine takes the buckets and the version, but keeps serving version 0 (a dropped update)
    engine.update_weights = lambda buckets, version: ([None for _ in buckets], setattr(engine, "weight_version",
                                                                                     version))
    with pytest.raises(WeightSyncError) as err:
        _sync_and_probe(learner, pool, 1, tol)
    assert "(version 1): it still serves version 0's weights" in _one_line(err)
    pool.close()


def test_garbled_bucket_fails():
    def shuffle(name, tensor):
        if name != SHUFFLED:
            return tensor
        order = torch.randperm(tensor.numel(), generator=torch.Generator().manual_seed(0))
        return tensor.flatten()[order].view_as(tensor)

    pool, _ = _pool(torch.bfloat16)
    with pytest.raises(WeightSyncError) as err:
        _sync_and_probe(FakeLearner(_model(), spoil=shuffle), pool, 0, default_tolerance("bfloat16"))
    text = _one_line(err)
    assert "(version 0): its dense log-probs of the probe sequence differ from the learner's by" in text
    assert text.endswith("> sync.probe_tolerance 0.3: garbled or wrong weights")
    pool.close()


def test_wrong_dtype_cast_fails():
    # bf16 bytes read as fp16 (a transport that mislabels the dtype): same size, other numbers
    def miscast(name, tensor):
        return tensor.to(torch.bfloat16).view(torch.float16)

    pool, _ = _pool(torch.bfloat16)
    with pytest.raises(WeightSyncError) as err:
        _sync_and_probe(FakeLearner(_model(), spoil=miscast), pool, 0, default_tolerance("bfloat16"))
    assert "garbled or wrong weights" in _one_line(err)
    pool.close()


def test_versions_closer_than_the_tolerance_are_not_called_stale():
    # learner 0 now, 0.05 before; the engine (noise 0.04) happens to sit nearer the previous version: the two
    # versions are 0.05 < 0.3 apart, which the probe cannot tell from noise -> passes
    current, previous, engine = torch.zeros(8), torch.full((8,), 0.05), torch.full((8,), 0.04)
    verdict = probe_verdict(engine, current, 0.3, 2, (1, previous))
    assert verdict.problem is None and verdict.previous_mean_abs_diff == pytest.approx(0.01)
    # the same engine against versions 0.5 apart that it is within the noise of: stale
    verdict = probe_verdict(torch.full((8,), 0.46), current, 0.3, 2, (1, torch.full((8,), 0.5)))
    assert verdict.problem.startswith("it still serves version 1's weights")
    # NaN is not within any tolerance
    assert "garbled" in probe_verdict(torch.full((8,), float("nan")), current, 0.3, 2).problem
