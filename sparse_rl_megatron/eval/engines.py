"""Rollout engines for evaluation, by name. ``hf``: the reference engine (CPU or GPU, any HF causal LM);
``sglang``: SGLang with the sparse_kv plugin, in-process (``rollout.sglang_engine``).

A factory takes ``(model_dir, config)`` and returns a ``RolloutEngine`` whose ``tokenizer`` attribute is
the model's tokenizer (the ``tokenizer`` prompt template needs it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from sparse_rl_megatron.eval.config import EvalConfig
from sparse_rl_megatron.utils.registry import Registry

EngineFactory = Callable[[Path, EvalConfig], object]
ENGINES: Registry[EngineFactory] = Registry("rollout engine")


@ENGINES.register("hf")
def hf_engine(model_dir: Path, config: EvalConfig):
    import torch

    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(
        str(model_dir), tokenizer=config.tokenizer, compression=config.compression,
        dtype=getattr(torch, config.dtype), max_batch_size=config.max_batch_size,
        show_progress=config.show_progress,
    )


@ENGINES.register("sglang")
def sglang_engine(model_dir: Path, config: EvalConfig):
    from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    return SGLangRolloutEngine(SGLangEngineConfig(
        model_path=str(model_dir), tokenizer_path=config.tokenizer or "", compression=config.compression,
        dtype=config.dtype, max_running_requests=config.max_batch_size, random_seed=config.seed))
