"""Rollout engines the trainer can drive, by name (``rollout.engine``).

An ``EngineSpec`` says how to build the engine from an HF model directory on global rank 0, how to get a view
of it with another KV compression (periodic evaluation runs dense AND sparse on the live weights), and how to
score a token sequence densely with it (the weight-sync probe). Adding an engine is one ``ENGINES.add``.

- ``hf``: the reference engine (``rollout/hf_engine.py``) in rank 0's process; weights arrive as tensors.
- ``sglang``: SGLang with the ``sparse_kv`` plugin (``rollout/sglang_engine.py``), an in-process ``sglang.Engine``
  on rank 0 or HTTP servers (``rollout.sglang.urls``); configured by ``rollout.sglang`` (an
  ``SGLangEngineConfig`` minus what the run and the rollout section give: model, compression, dtype). Weights
  go by ``rollout.sglang.weight_sync`` (tensor / distributed / disk); its evaluation views are per-request
  compression overrides on the same server; the probe scores the sequence with SGLang's input log-probs.
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


def _no_plugin_options(rollout: "RolloutConfig") -> None:
    if rollout.engine_options:
        raise ValueError(f"rollout.engine_options: the {rollout.engine} engine takes no options, got "
                         f"{sorted(rollout.engine_options)}")


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-row log-probs -> ``[len(rows), width]``, 0 past each row's end."""
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def _hf_build(model_dir: str, rollout: "RolloutConfig", show_progress: bool):
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    _no_plugin_options(rollout)
    return HFRolloutEngine(model_dir, compression=rollout.compression, dtype=getattr(torch, rollout.dtype),
                           max_batch_size=rollout.max_batch_size, show_progress=show_progress)


def _hf_with_compression(engine, compression):
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(engine.model, engine.tokenizer, compression=compression, dtype=engine.dtype,
                           max_batch_size=engine.max_batch_size, show_progress=engine.show_progress,
                           weight_version=engine.weight_version)


@torch.no_grad()
def _hf_dense_logprobs(engine, seqs: "SequenceBatch") -> torch.Tensor:
    rows = []
    for prompt, response in zip(seqs.prompts, seqs.responses):
        if response.numel() == 0:
            rows.append(torch.zeros(0))
            continue
        ids = torch.cat([prompt, response]).unsqueeze(0).to(engine.device)
        logits = engine.model(input_ids=ids).logits[0, prompt.numel() - 1:-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, response.to(logits.device).unsqueeze(-1)).squeeze(-1)
        rows.append(lp.cpu())
    return _padded(rows, seqs.max_response_len)


ENGINES.add("hf", EngineSpec(build=_hf_build, with_compression=_hf_with_compression,
                             dense_logprobs=_hf_dense_logprobs))


def _sglang_build(model_dir: str, rollout: "RolloutConfig", show_progress: bool):
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    _no_plugin_options(rollout)
    return SGLangRolloutEngine(rollout.sglang_config(model_dir))


def _sglang_dense_logprobs(engine, seqs: "SequenceBatch") -> torch.Tensor:
    keep = [i for i, r in enumerate(seqs.responses) if r.numel() > 0]
    scored = engine.dense_logprobs([seqs.prompts[i].tolist() for i in keep], [seqs.responses[i].tolist() for i in keep])
    rows = [torch.zeros(0)] * len(seqs)
    for i, row in zip(keep, scored):
        rows[i] = row
    return _padded(rows, seqs.max_response_len)


ENGINES.add("sglang", EngineSpec(build=_sglang_build, with_compression=lambda engine, c: engine.with_compression(c),
                                 dense_logprobs=_sglang_dense_logprobs))
