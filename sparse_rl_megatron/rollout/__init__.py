"""Rollout engines and what they return.

- ``sample``: :class:`Sample` / :class:`CompressionInfo` (provenance travels with the data).
- ``engine``: :class:`SamplingParams` and the :class:`RolloutEngine` protocol (everything callers use of an engine).
- ``engines``: ``ENGINES``, the engines by name (``EngineSpec``), each built from an ``EngineBuild``; the trainer,
  ``sparse-rl eval`` and ``sparse-rl mismatch`` build theirs here.
- ``hf_engine``: :class:`HFRolloutEngine`, the HF-transformers reference engine with KV compression
  (``hf_forward`` decode pass, ``kv_cache`` per-head compressed cache, ``sampling``, ``stopping``, ``weights``);
  its ``teacher_forced`` mode is the oracle other engines are checked against.
- ``sglang_engine``: :class:`SGLangRolloutEngine` on SGLang with the ``sparse_kv`` plugin (``sglang_config``,
  ``sglang_client`` in-process / HTTP, ``sglang_weights`` weight sync).

Engines are imported lazily so that ``import sparse_rl_megatron.rollout.sample`` stays light.
"""
from __future__ import annotations

from typing import Any

__all__ = ["CompressionInfo", "HFRolloutEngine", "RolloutEngine", "SGLangEngineConfig", "SGLangRolloutEngine",
           "Sample", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("Sample", "CompressionInfo"):
        from sparse_rl_megatron.rollout import sample

        return getattr(sample, name)
    if name in ("SamplingParams", "RolloutEngine"):
        from sparse_rl_megatron.rollout import engine_protocol

        return getattr(engine_protocol, name)
    if name == "HFRolloutEngine":
        from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine
    if name == "SGLangRolloutEngine":
        from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

        return SGLangRolloutEngine
    if name == "SGLangEngineConfig":
        from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

        return SGLangEngineConfig
    raise AttributeError(f"module 'sparse_rl_megatron.rollout' has no attribute '{name}'")
