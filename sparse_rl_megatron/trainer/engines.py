"""Rollout engines the trainer can drive, by name (``rollout.engine``).

An ``EngineSpec`` says how to build the engine from an HF model directory on global rank 0, how to get a view
of it with another KV compression (periodic evaluation runs dense AND sparse on the live weights), and how to
score a token sequence densely with it (the weight-sync probe). Adding an engine is one ``ENGINES.add``.

- ``hf``: the reference engine (``rollout/hf_engine.py``) in rank 0's process; weights arrive as tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from sparse_rl_megatron.utils.registry import Registry

if TYPE_CHECKING:
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.learner.batch import SequenceBatch
    from sparse_rl_megatron.rollout.engine import RolloutEngine
    from sparse_rl_megatron.trainer.config import RolloutConfig


@dataclass(frozen=True)
class EngineSpec:
    """How the trainer builds and uses one kind of rollout engine."""

    build: Callable[[str, "RolloutConfig", bool], "RolloutEngine"]
    """``(hf_model_dir, rollout config, show_progress) -> engine`` (rank 0 only)."""
    with_compression: Callable[["RolloutEngine", "CompressionConfig"], "RolloutEngine"]
    """A view of the engine that samples with another KV compression and serves the same (live) weights."""
    dense_logprobs: Callable[["RolloutEngine", "SequenceBatch"], torch.Tensor]
    """``[B, T]`` log-probs of each row's response tokens under full attention, 0 at padding."""


ENGINES: Registry[EngineSpec] = Registry("rollout engine")


def _hf_build(model_dir: str, rollout: "RolloutConfig", show_progress: bool):
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    if rollout.engine_options:
        raise ValueError(f"rollout.engine_options: the hf engine takes no options, got {sorted(rollout.engine_options)}")
    return HFRolloutEngine(model_dir, compression=rollout.compression, dtype=getattr(torch, rollout.dtype),
                           max_batch_size=rollout.max_batch_size, show_progress=show_progress)


def _hf_with_compression(engine, compression):
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(engine.model, engine.tokenizer, compression=compression, dtype=engine.dtype,
                           max_batch_size=engine.max_batch_size, show_progress=engine.show_progress,
                           weight_version=engine.weight_version)


@torch.no_grad()
def _hf_dense_logprobs(engine, seqs: "SequenceBatch") -> torch.Tensor:
    out = torch.zeros(len(seqs), seqs.max_response_len, dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(seqs.prompts, seqs.responses)):
        if response.numel() == 0:
            continue
        ids = torch.cat([prompt, response]).unsqueeze(0).to(engine.device)
        logits = engine.model(input_ids=ids).logits[0, prompt.numel() - 1:-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, response.to(logits.device).unsqueeze(-1)).squeeze(-1)
        out[i, : response.numel()] = lp.cpu()
    return out


ENGINES.add("hf", EngineSpec(build=_hf_build, with_compression=_hf_with_compression,
                             dense_logprobs=_hf_dense_logprobs))
