"""Rollout engines the trainer can drive, by name (``rollout.engine``).

An ``EngineSpec`` says how to build one engine from an HF model directory on the rank that drives it (the
run has one per ``rollout.gpus_per_engine`` ranks, or one per server URL: ``rollout/layout.py``), how to get a
view of it with another KV compression (periodic evaluation runs dense AND sparse on the live weights), and how
to score a token sequence densely with it (the weight-sync probe). Adding an engine is one ``ENGINES.add``; an
engine that can be one of several takes ``generate(..., group_ids=...)`` (the global GRPO group ids).

- ``hf``: the reference engine (``rollout/hf_engine.py``) in its rank's process, on CPU; weights arrive as
  tensors. One per rank by default (every rank samples its share).
- ``sglang``: SGLang with the ``sparse_kv`` plugin (``rollout/sglang_engine.py``), an in-process ``sglang.Engine``
  on its group's GPUs (``base_gpu_id`` / ``tp_size``) or HTTP servers (``rollout.sglang.urls``); configured by
  ``rollout.sglang`` (an ``SGLangEngineConfig`` minus what the run and the layout give). Weights go by
  ``rollout.sglang.weight_sync``: ``tensor`` in process (per-TP-rank payloads from the learner ranks on the
  engine's GPUs: CUDA-IPC handles on GPU), ``distributed`` / ``disk`` to servers; its evaluation views are
  per-request compression overrides on the same server; the probe scores the sequence with SGLang's input
  log-probs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from sparse_rl_megatron.utils.registry import Registry

if TYPE_CHECKING:
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.learner.batch import SequenceBatch
    from sparse_rl_megatron.rollout.engine import RolloutEngine
    from sparse_rl_megatron.rollout.layout import EngineSlot
    from sparse_rl_megatron.trainer.config import RolloutConfig


@dataclass(frozen=True)
class EngineSpec:
    """How the trainer builds and uses one kind of rollout engine."""

    build: Callable[[str, "RolloutConfig", bool], "RolloutEngine"]
    """``(hf_model_dir, rollout config, show_progress) -> engine`` for an engine that needs no placement."""
    with_compression: Callable[["RolloutEngine", "CompressionConfig"], "RolloutEngine"]
    """A view of the engine that samples with another KV compression and serves the same (live) weights."""
    dense_logprobs: Callable[["RolloutEngine", "SequenceBatch"], torch.Tensor]
    """``[B, T]`` log-probs of each row's response tokens under full attention, 0 at padding."""
    build_at: Callable[[str, "RolloutConfig", bool, "EngineSlot"], "RolloutEngine"] | None = None
    """``build`` for one slot of the layout (its GPUs, its server URL); None: ``build`` (placement ignored)."""
    tensor_parallel: bool = False
    """The engine shards itself over its GPUs (``rollout.gpus_per_engine`` is its TP size)."""
    payload_sync: Callable[["RolloutConfig"], bool] | None = None
    """Whether colocated engines of this config load buckets serialized per TP rank (``update_weights_from_payloads``,
    each TP rank's from the learner rank on its GPU) instead of ``update_weights``; None: never."""

    def make(self, model_dir: str, rollout: "RolloutConfig", show_progress: bool, slot: "EngineSlot"):
        """The engine of ``slot``."""
        if self.build_at is not None:
            return self.build_at(model_dir, rollout, show_progress, slot)
        return self.build(model_dir, rollout, show_progress)


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


def _sglang_build_at(model_dir: str, rollout: "RolloutConfig", show_progress: bool, slot: "EngineSlot"):
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    _no_plugin_options(rollout)
    urls = [slot.url] if slot.url else None
    config = rollout.sglang_config(model_dir, base_gpu_id=slot.base_gpu_id, urls=urls)
    # SGLang samples from its scheduler's RNG (it ignores per-request seeds with the sparse_kv backend): engines
    # with the same random_seed would draw the same random numbers for their different groups
    return SGLangRolloutEngine(dataclasses.replace(config, random_seed=(config.random_seed or 0) + slot.index))


def _sglang_dense_logprobs(engine, seqs: "SequenceBatch") -> torch.Tensor:
    keep = [i for i, r in enumerate(seqs.responses) if r.numel() > 0]
    scored = engine.dense_logprobs([seqs.prompts[i].tolist() for i in keep], [seqs.responses[i].tolist() for i in keep])
    rows = [torch.zeros(0)] * len(seqs)
    for i, row in zip(keep, scored):
        rows[i] = row
    return _padded(rows, seqs.max_response_len)


ENGINES.add("sglang", EngineSpec(build=_sglang_build, with_compression=lambda engine, c: engine.with_compression(c),
                                 dense_logprobs=_sglang_dense_logprobs, build_at=_sglang_build_at,
                                 tensor_parallel=True,
                                 payload_sync=lambda r: not r.sglang.urls and r.sglang.weight_sync == "tensor"))
