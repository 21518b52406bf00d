"""Rollout engines by name: the one registry the trainer (``rollout.engine``), ``sparse-rl eval`` (``--engine``)
and ``sparse-rl mismatch`` build their engines from.

An engine is built from an ``EngineBuild``: what its caller decided (the run: ``RolloutConfig.engine_build``, which
fills the run-owned fields; an evaluation: ``EvalConfig.engine_build``). Everything else the callers do with an
engine is the ``RolloutEngine`` protocol (``rollout/engine_protocol.py``). Adding an engine is one ``ENGINES.add``.

- ``hf``: the reference engine (``rollout/hf_engine.py``) in its caller's process (CPU or GPU); weights arrive as
  tensors. The run has one per rank by default (every rank samples its share).
- ``sglang``: SGLang with the ``sparse_kv`` plugin (``rollout/sglang_engine.py``), an in-process ``sglang.Engine``
  on its GPUs (``base_gpu_id`` / ``tp_size``) or HTTP servers (``urls``), configured by ``EngineBuild.sglang``.
  Weights go by its ``weight_sync``: ``tensor`` in process (per-TP-rank payloads from the learner ranks on the
  engine's GPUs: CUDA-IPC handles on GPU), ``distributed`` / ``disk`` to servers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import missing_members
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine
from sparse_rl_megatron.utils.dtypes import DTYPE_NAMES, DtypeName
from sparse_rl_megatron.utils.registry import Registry

if TYPE_CHECKING:
    from sparse_rl_megatron.rollout.engine_protocol import RolloutEngine
    from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig


EngineDtype = DtypeName
"""Compute dtypes a rollout engine runs in (``rollout.dtype``, ``sparse-rl eval``'s ``dtype``)."""
ENGINE_DTYPES: tuple[str, ...] = DTYPE_NAMES


@dataclass(frozen=True)
class EngineBuild:
    """Everything one engine is built from."""

    model_dir: str
    """The HF model directory the engine loads."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """KV compression while sampling (``hf``; ``sglang`` takes its own from ``sglang``)."""
    dtype: EngineDtype = "float32"
    """Compute dtype of the weights and the KV cache (``hf``)."""
    max_batch_size: int = 64
    """Most sequences decoded together (``hf``)."""
    show_progress: bool = False
    """A progress bar while sampling (``hf``)."""
    tokenizer: str | None = None
    """A directory to load the tokenizer from; None: the model directory's (``hf``)."""
    record_routing: bool = False
    """Record every sample's routed experts (``Sample.routed_experts``) for the learner's routing replay
    (``learner.moe.routing_replay``; ``hf``, mixtures of experts)."""
    sglang: "SGLangEngineConfig | None" = None
    """The full config of an ``sglang`` engine (placement, servers, weight sync, run-owned fields filled in)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options of an engine registered by a plugin (``rollout.engine_options``); the built-in engines take none."""


@dataclass(frozen=True)
class EngineSpec:
    """How to build one kind of rollout engine, and what the run's placement needs to know of it."""

    build: Callable[[EngineBuild], "RolloutEngine"]
    """The engine of an ``EngineBuild``."""
    tensor_parallel: bool = False
    """The engine shards itself over its GPUs (``rollout.gpus_per_engine`` is its TP size)."""
    payload_sync: Callable[[EngineBuild], bool] | None = None
    """Whether colocated engines built from this ``EngineBuild`` load buckets serialized per TP rank
    (``RolloutEngine.update_weights_from_payloads``, each TP rank's from the learner rank on its GPU) instead of
    ``update_weights``; decided on every rank, engine or not (they all serialize their copy); None: never."""

    def make(self, build: EngineBuild) -> "RolloutEngine":
        """``build``'s engine, checked against the ``RolloutEngine`` protocol: an engine (a plugin's) that lacks
        part of it is shut down and refused here with the missing members named."""
        engine = self.build(build)
        missing = missing_members(engine)
        if missing:
            if "shutdown" not in missing:
                engine.shutdown()
            raise TypeError(f"rollout engine {type(engine).__qualname__} does not implement the RolloutEngine "
                            f"protocol (rollout/engine_protocol.py): it lacks {', '.join(missing)}")
        return engine

    def takes_payloads(self, build: EngineBuild) -> bool:
        return self.payload_sync is not None and self.payload_sync(build)


ENGINES: Registry[EngineSpec] = Registry("rollout engine")


def no_plugin_options(name: str, build: EngineBuild) -> None:
    """Refuse ``engine_options`` for an engine that takes none."""
    if build.options:
        raise ValueError(f"rollout.engine_options: the {name} engine takes no options, got {sorted(build.options)}")


def _hf(build: EngineBuild) -> "RolloutEngine":
    import torch

    no_plugin_options("hf", build)
    return HFRolloutEngine(build.model_dir, tokenizer=build.tokenizer, compression=build.compression,
                           dtype=getattr(torch, build.dtype), max_batch_size=build.max_batch_size,
                           show_progress=build.show_progress, record_routing=build.record_routing)


def _sglang(build: EngineBuild) -> "RolloutEngine":
    no_plugin_options("sglang", build)
    if build.sglang is None:
        raise ValueError("the sglang engine needs its SGLangEngineConfig (EngineBuild.sglang)")
    return SGLangRolloutEngine(build.sglang)


def _sglang_payload_sync(build: EngineBuild) -> bool:
    return build.sglang is not None and build.sglang.takes_payloads


ENGINES.add("hf", EngineSpec(build=_hf))
ENGINES.add("sglang", EngineSpec(build=_sglang, tensor_parallel=True, payload_sync=_sglang_payload_sync))
