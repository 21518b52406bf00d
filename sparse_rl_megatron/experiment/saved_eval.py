"""A saved model evaluated by the trainer's held-out evaluation under several KV caches, on one engine.

Preflight runs once and the rollout engine and the reward are built once; each ``(compression, work dir)``
pair is one ``evaluate`` (its ``eval.compression`` replaced, unless None; its files under the work dir). The
engine is shut down at the end, also when an evaluation fails, as ``EnginePool.start`` does for the trainer's
engines (``RolloutEngine.shutdown``: SGLang's servers and child processes; nothing for the HF engine).

One engine serves every cache: ``evaluate`` samples each mode through ``engine.with_compression(c)``
(the HF engine: a new ``HFRolloutEngine`` on the same model with ``c``; SGLang: ``c`` sent with every request),
never with the cache the engine was built with, and the engine is built from ``cfg.rollout``, which the pairs
do not change. So an engine per cache would be built from the same arguments.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Sequence
from sparse_rl_megatron.rollout.engine_registry import ENGINES
from sparse_rl_megatron.trainer.evaluation import evaluate
from sparse_rl_megatron.trainer.run import make_reward
from sparse_rl_megatron.trainer.run_plan import preflight

if TYPE_CHECKING:
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.trainer.config import TrainConfig


def evaluate_saved(cfg: "TrainConfig", model: str | Path, step: int,
                   caches: Sequence[tuple["CompressionConfig | None", str | Path]]) -> list[dict[str, float]]:
    """``evaluate``'s metrics of the HF model ``model`` (logged as ``step``) under each cache of ``caches``, in
    order (module docstring)."""
    plan = preflight(cfg, 1, lengths=("eval",))  # evaluations only: the rollout's length is not used
    spec = ENGINES.get(cfg.rollout.engine)
    with contextlib.ExitStack() as stack:
        engine = spec.make(cfg.rollout.engine_build(str(model)))
        stack.callback(engine.shutdown)
        reward = stack.enter_context(make_reward(cfg, plan))
        results = []
        for compression, work in caches:
            ecfg = cfg if compression is None else dataclasses.replace(
                cfg, eval=dataclasses.replace(cfg.eval, compression=compression))
            results.append(evaluate(engine, reward, plan.eval_data, ecfg, plan.template, step, work))
        return results
