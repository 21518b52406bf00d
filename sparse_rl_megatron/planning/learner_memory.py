"""Learner memory per GPU, stage by stage: weights, gradients, optimizer state, activations, log-prob buffers.

Static bytes per parameter (megatron-core mixed precision, the learner's ``grad_reduce_in_fp32=True``): bf16
parameters 2 + fp32 gradients 4 + fp32 master weights and Adam moments 12 (18 in all; 6 + 12 / DP with the
distributed optimizer); fp32 parameters 4 + 4 + Adam moments 8 (16; 8 + 8 / DP). A mixture of experts' routed
experts are sharded over the expert data-parallel ranks (TP x DP / (EP x expert TP)) instead of DP. Activations: the kernel set's
per-layer figures (``activations.py``) for one micro-batch, times the micro-batches in flight on the stage
(1F1B: stage k holds min(PP - k, micro-batches) of them); with full recompute only each layer's input
[tokens, h] is kept and one layer's activations are rebuilt at a time. Temporaries on top, the larger of:
the LM-head chunk on the last stage (``[chunk, vocab / TP]`` fp32 logits, the matmul output in the parameter
dtype, and the head's weight gradient ``[vocab / TP, h]``), or one layer's attention temporaries (plus, with
recompute, the rebuilt layer), which never coincide with the head's saved logits (the head runs after the
last layer's forward and before its backward).
"""
from __future__ import annotations

from dataclasses import dataclass

from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.planning.activations import (
    INPUT_ID_BYTES,
    KERNELS,
    LOSS_BYTES_PER_SCORED_TOKEN,
    ROPE_EMBEDDING_BYTES,
    MicroBatchShape,
    layer_bytes,
    micro_batches,
)
from sparse_rl_megatron.planning.inputs import BatchShape, Layout, LearnerSetting
from sparse_rl_megatron.planning.params import stage_expert_params, stage_params

FP32 = 4


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of pipeline stage ``stage`` (every TP rank of a stage holds the same)."""

    stage: int
    params: int
    """Parameters held (count, not bytes)."""
    weights: float
    gradients: float
    optimizer: float
    """fp32 master weights (bf16 only) + Adam moments, unsharded."""
    optimizer_distributed: float
    """The same sharded over DP by the distributed optimizer (routed experts over the expert DP ranks)."""
    reference: float
    """A frozen KL reference policy's weights (0 without one)."""
    in_flight: int
    """Micro-batches whose activations the stage holds at once."""
    activations: float
    """Kept for backward, all micro-batches in flight, no recompute."""
    activations_recompute: float
    """The same with full recompute (layer inputs only)."""
    head_saved: float
    """Of ``activations``: the unchunked head's fp32 logits (last stage; 0 when chunked)."""
    head_temporary: float
    """LM-head chunk: fp32 logits + the matmul output + the head's weight gradient (last stage)."""
    layer_temporary: float
    """One layer's attention temporaries."""
    recompute_temporary: float
    """With recompute: one layer's rebuilt activations + its attention temporaries."""

    def total(self, setting: LearnerSetting) -> float:
        opt = self.optimizer_distributed if setting.distributed_optimizer else self.optimizer
        act = self.activations_recompute if setting.recompute else self.activations
        layer = self.recompute_temporary if setting.recompute else self.layer_temporary
        return self.weights + self.gradients + opt + self.reference_training(setting) + act + max(
            self.head_temporary, layer - self.head_saved)

    def reference_training(self, setting: LearnerSetting) -> float:
        """The KL reference's weights while the policy trains: asleep (0) when ``setting.offload`` puts weights to
        sleep (the train turn, ``learner/turns.py``, needs only the policy), else on the device."""
        from sparse_rl_megatron.learner.offload import offload_parts

        return 0.0 if "weights" in offload_parts(setting.offload) else self.reference


def learner_micro_batch(batch: BatchShape, layout: Layout, setting: LearnerSetting) -> MicroBatchShape:
    rows_per_rank = -(-batch.rollouts // layout.dp)
    return micro_batches(rows_per_rank, batch.fed_tokens, batch.response_len, setting.max_tokens_per_device)


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes of one micro-batch on one GPU of a stage."""

    kept: float
    """Kept for backward, no recompute."""
    kept_recompute: float
    """Kept with full recompute (each layer's input)."""
    layer: float
    """Kept by one layer (what a recompute rebuilds at a time)."""
    head_saved: float
    """Of ``kept``: the unchunked head's fp32 logits."""
    head_temporary: float
    attention_temporary: float


def stage_activations(arch: ModelArch, tp: int, pp: int, stage: int, mb: MicroBatchShape,
                      setting: LearnerSetting, etp: int | None = None) -> StageActivations:
    """The activation bytes of micro-batch ``mb`` on one GPU of ``stage`` (``etp``: expert TP, default TP)."""
    etp = tp if etp is None else etp
    e = setting.param_bytes
    layer = KERNELS.get(setting.kernels)(arch, tp, e, etp)
    per_layer = layer_bytes(layer, mb)
    vocab_local = arch.padded_vocab_size(tp) // tp
    chunked = 0 < setting.logprob_chunk_tokens < mb.scored
    mask = layer.mask_per_square * mb.row_len ** 2  # built inside the layers: a recompute rebuilds it
    extras = INPUT_ID_BYTES * mb.tokens if stage == 0 else 0
    head_temp = head_saved = 0.0
    if stage == pp - 1:
        extras += layer.final_norm_per_token * mb.tokens + e * arch.hidden_size * mb.scored
        extras += LOSS_BYTES_PER_SCORED_TOKEN * mb.scored
        if not chunked:  # unchunked, the fp32 logits stay saved for backward
            head_saved = FP32 * mb.scored * vocab_local
        matmul_out = e if e < FP32 else 0  # the head's output before .float() when params are not fp32
        head_tokens = setting.logprob_chunk_tokens if chunked else mb.scored
        head_temp = head_tokens * vocab_local * (matmul_out + (FP32 if chunked else 0))
        head_temp += e * vocab_local * arch.hidden_size  # the head's weight gradient before accumulation
    layers = arch.num_layers // pp
    return StageActivations(
        kept=layers * per_layer + mask + extras + head_saved,
        kept_recompute=(layers * e * arch.hidden_size * mb.tokens + ROPE_EMBEDDING_BYTES * arch.head_dim * mb.row_len
                        + extras + head_saved),
        layer=per_layer, head_saved=head_saved, head_temporary=head_temp,
        attention_temporary=layer.temporary_per_row_square * mb.rows * mb.row_len ** 2,
    )


def learner_memory(arch: ModelArch, layout: Layout, batch: BatchShape, setting: LearnerSetting) -> list[StageMemory]:
    """One ``StageMemory`` per pipeline stage."""
    e = setting.param_bytes
    mb = learner_micro_batch(batch, layout, setting)
    out = []
    experts = stage_expert_params(arch, layout.pp, layout.ep, layout.expert_tp)
    per_param = 12 if e == 2 else 8
    for stage, n in enumerate(stage_params(arch, layout.tp, layout.pp, layout.ep, layout.expert_tp)):
        act = stage_activations(arch, layout.tp, layout.pp, stage, mb, setting, layout.expert_tp)
        in_flight = min(layout.pp - stage, mb.count)
        opt_bytes = per_param * n
        sharded = -(-per_param * (n - experts) // layout.dp) + -(-per_param * experts // layout.expert_dp)
        out.append(StageMemory(
            stage=stage, params=n, weights=e * n, gradients=FP32 * n, optimizer=opt_bytes,
            optimizer_distributed=sharded, reference=e * n if setting.reference_model else 0,
            in_flight=in_flight, activations=in_flight * act.kept, activations_recompute=in_flight * act.kept_recompute,
            head_saved=act.head_saved, head_temporary=act.head_temporary, layer_temporary=act.attention_temporary,
            recompute_temporary=act.layer + act.attention_temporary,
        ))
    return out


def peak_stage(stages: list[StageMemory], setting: LearnerSetting) -> StageMemory:
    """The stage that needs the most memory."""
    return max(stages, key=lambda s: s.total(setting))
