"""Rollout KV budget: bytes per sequence dense vs compressed, and how many sequences a KV pool holds at once.

KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x dtype bytes; on one GPU of a TP engine
the KV heads are split (or replicated when TP exceeds them: ceil(KV heads / TP) per GPU). Tokens held per
sequence at its peak are ``CompressionSchedule.capacity``, the rule the engines themselves allocate by: dense
prompt + response - 1 (the last token is never fed); compressed (scope all) at most B + W, or the prompt + 1
when the prompt alone exceeds B + W.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sparse_rl_megatron.compression import CompressionConfig, CompressionSchedule
from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.planning.inputs import BatchShape, DTYPE_BYTES, Layout, RolloutSetting
from sparse_rl_megatron.planning.params import total_params
from sparse_rl_megatron.rollout.layout import RolloutLayout


def kv_bytes_per_token(arch: ModelArch, kv_dtype: str = "bfloat16", tp: int = 1) -> int:
    """K + V bytes of one token on one GPU of a TP engine (all layers)."""
    heads = math.ceil(arch.num_query_groups / tp)
    return 2 * arch.num_layers * heads * arch.head_dim * DTYPE_BYTES[kv_dtype]


def kv_tokens_per_sequence(batch: BatchShape, compression=None) -> int:
    """Peak KV tokens one sequence holds (per layer and KV head); ``compression`` None means dense."""
    return CompressionSchedule(compression or CompressionConfig()).capacity(batch.prompt_len, batch.response_len)


@dataclass(frozen=True)
class RolloutKV:
    """The KV side of one rollout setting (dense or compressed)."""

    label: str
    tokens_per_sequence: int
    bytes_per_sequence: int
    """Whole engine (all its GPUs)."""
    bytes_per_sequence_per_gpu: int
    pool_per_gpu: float
    concurrent_per_engine: int
    engines: int
    waves: int
    """Rounds of concurrent decoding needed for one step's rollouts (0 when nothing fits)."""
    plugin: object = None
    """The sparse_kv plugin's memory per GPU of an SGLang engine (``sglang_ext.memory.PluginMemory``; compressed
    settings only). It is taken out of the KV budget, so ``pool_per_gpu`` is already without it."""

    @property
    def concurrent(self) -> int:
        return self.concurrent_per_engine * self.engines


def engine_weights_per_gpu(arch: ModelArch, rollout: RolloutSetting) -> float:
    """The engine's bf16 weights on one of its GPUs (``2 N_total / rollout TP``)."""
    return DTYPE_BYTES["bfloat16"] * total_params(arch) / rollout.tp


def kv_pool_per_gpu(arch: ModelArch, layout: Layout, rollout: RolloutSetting, resident: float = 0.0) -> float:
    """KV pool bytes per GPU: as given, else SGLang's budget from the memory free when the engine starts,
    ``mem_fraction x (GPU memory - resident) - the engine's bf16 weights per GPU``, where ``resident`` is what the
    colocated learner keeps on the GPU while it sleeps (``docs/memory-planning.md``, "The SGLang pool")."""
    if rollout.kv_pool_gib is not None:
        return rollout.kv_pool_gib * 2 ** 30
    free = layout.gpu_memory_gib * 2 ** 30 - resident
    return rollout.mem_fraction * free - engine_weights_per_gpu(arch, rollout)


def plugin_memory_per_gpu(arch: ModelArch, rollout: RolloutSetting, compression):
    """What the sparse_kv plugin allocates on one GPU of an SGLang engine (``sglang_ext.memory``), for the rows
    SGLang gives the request pool and its row width (the model's context length + SGLang's extra)."""
    from sglang_ext.memory import SGLANG_MAX_DEFAULT_ROWS, SGLANG_ROW_EXTRA, plugin_memory

    return plugin_memory(
        rows=(rollout.max_running_requests or SGLANG_MAX_DEFAULT_ROWS) + 1,
        width=arch.max_position_embeddings + SGLANG_ROW_EXTRA, layers=arch.num_layers,
        q_heads=arch.num_attention_heads // rollout.tp, kv_heads=math.ceil(arch.num_query_groups / rollout.tp),
        head_dim=arch.head_dim, window=compression.window, max_candidates=compression.max_candidates,
        ring_itemsize=DTYPE_BYTES[rollout.kv_dtype], keep_queries=True, keep_positions=rollout.kept_digest)


def engine_layout(layout: Layout, batch: BatchShape, rollout: RolloutSetting):
    """The colocated rollout engines ``sparse-rl train`` starts on these GPUs: one per ``rollout.tp`` GPUs on every
    node (``rollout/layout.py``, the object the trainer starts them from)."""
    return RolloutLayout.build(engine="sglang", world=layout.gpus,
                               ranks_per_node=min(layout.gpus_per_node, layout.gpus), gpus_per_engine=rollout.tp,
                               groups=batch.prompts, on_gpu=True)


def rollout_kv(arch: ModelArch, layout: Layout, batch: BatchShape, rollout: RolloutSetting,
               compression=None, label: str = "dense", resident: float = 0.0) -> RolloutKV:
    """KV figures of one setting, with the rollout engines on the learner's GPUs (colocated: ``resident`` bytes of
    the sleeping learner stay on each GPU when the engine starts). A compressed setting runs SGLang with the
    sparse_kv plugin, whose memory comes out of a derived KV pool (a given ``--kv-pool`` is the pool SGLang ends up
    with)."""
    tokens = kv_tokens_per_sequence(batch, compression)
    per_gpu = tokens * kv_bytes_per_token(arch, rollout.kv_dtype, rollout.tp)
    pool = kv_pool_per_gpu(arch, layout, rollout, resident)
    plugin = None
    if compression is not None and not compression.is_dense:
        plugin = plugin_memory_per_gpu(arch, rollout, compression)
        if rollout.kv_pool_gib is None:
            pool -= plugin.total
    concurrent = max(0, int(pool // per_gpu))
    engines = engine_layout(layout, batch, rollout).num_engines
    total = concurrent * engines
    return RolloutKV(label=label, tokens_per_sequence=tokens,
                     bytes_per_sequence=tokens * kv_bytes_per_token(arch, rollout.kv_dtype),
                     bytes_per_sequence_per_gpu=per_gpu, pool_per_gpu=pool, concurrent_per_engine=concurrent,
                     engines=engines, waves=-(-batch.rollouts // total) if total else 0, plugin=plugin)


def smallest_rollout_tp(arch: ModelArch, layout: Layout, batch: BatchShape, rollout: RolloutSetting,
                        compression=None, resident: float = 0.0) -> int | None:
    """The smallest rollout TP (dividing the GPUs, within a node) at which one sequence fits the KV pool."""
    import dataclasses

    for tp in range(1, min(layout.gpus, layout.gpus_per_node) + 1):
        if min(layout.gpus, layout.gpus_per_node) % tp == 0:
            kv = rollout_kv(arch, layout, batch, dataclasses.replace(rollout, tp=tp), compression, resident=resident)
            if kv.concurrent_per_engine >= 1:
                return tp
    return None
