"""A whole plan: learner memory per stage, the rollout KV budget dense vs compressed, and a suggestion when the
learner does not fit."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.planning.activations import MicroBatch
from sparse_rl_megatron.planning.inputs import GIB, BatchShape, Layout, LearnerSetting, RolloutSetting
from sparse_rl_megatron.planning.kv import RolloutKV, engine_layout, rollout_kv, smallest_rollout_tp
from sparse_rl_megatron.planning.learner_memory import StageMemory, learner_memory, learner_micro_batch, peak_stage
from sparse_rl_megatron.planning.params import activated_params, total_params
from sparse_rl_megatron.planning.search import Suggestion, check_layout, suggest

if TYPE_CHECKING:
    from sparse_rl_megatron.rollout.layout import RolloutLayout


@dataclass(frozen=True)
class Plan:
    model: str
    arch: ModelArch
    layout: Layout
    batch: BatchShape
    learner: LearnerSetting
    rollout: RolloutSetting
    micro_batch: MicroBatch
    stages: list[StageMemory]
    kv: list[RolloutKV]
    """Dense first, then the compressed setting (when one was given)."""
    suggestion: Suggestion | None
    """The nearest fitting layout when this one does not fit (None when it fits, or nothing does)."""
    rollout_tp_hint: int | None = None
    """The smallest rollout TP at which a sequence fits, when none fits at the given one."""
    engines: "RolloutLayout | None" = None
    """The rollout engines ``sparse-rl train`` starts on this layout (the line it prints)."""

    @property
    def peak(self) -> StageMemory:
        return peak_stage(self.stages, self.learner)

    @property
    def fits(self) -> bool:
        """The learner fits its GPUs."""
        return self.peak.total(self.learner) <= self.layout.gpu_memory_gib * GIB

    @property
    def rollout_fits(self) -> bool:
        """At least one sequence (of the last KV setting) fits each rollout engine."""
        return self.kv[-1].concurrent_per_engine >= 1

    @property
    def total_params(self) -> int:
        return total_params(self.arch)

    @property
    def activated_params(self) -> int:
        """Parameters a token passes through (a mixture of experts: ``top_k`` of each layer's experts)."""
        return activated_params(self.arch)


def build_plan(model: str, arch: ModelArch, layout: Layout, batch: BatchShape, learner: LearnerSetting,
               rollout: RolloutSetting, compression=None, mean_budget: int | None = None) -> Plan:
    """``compression``: a ``CompressionConfig`` to put next to dense (None: dense only). ``mean_budget``: an adaptive
    budget's mean, shown as one more column before ``compression`` (whose budget is then the worst case, B_max, which
    is what the fit is judged on)."""
    check_layout(arch, layout)
    node = min(layout.gpus, layout.gpus_per_node)
    if layout.gpus % node:
        raise ValueError(f"{layout.gpus} GPUs are not whole nodes of --gpus-per-node {layout.gpus_per_node}")
    if node % rollout.tp:
        raise ValueError(f"--rollout-tp {rollout.tp} does not divide the {node} GPUs of a node (an engine's GPUs are "
                         f"on one node); valid --rollout-tp values: "
                         f"{', '.join(str(d) for d in range(1, node + 1) if node % d == 0)}")
    engines = engine_layout(layout, batch, rollout)
    stages = learner_memory(arch, layout, batch, learner)
    kv = [rollout_kv(arch, layout, batch, rollout)]
    if compression is not None and not compression.is_dense:
        label = f"{compression.method} B={compression.budget} W={compression.buffer}"
        if mean_budget is not None:
            mean = dataclasses.replace(compression, budget=mean_budget)
            kv.append(rollout_kv(arch, layout, batch, rollout, mean,
                                 label=f"{mean.method} B={mean.budget} W={mean.buffer} (mean)"))
            label += " (B_max)"
        kv.append(rollout_kv(arch, layout, batch, rollout, compression, label=label))
    fits = peak_stage(stages, learner).total(learner) <= layout.gpu_memory_gib * GIB
    hint = None
    if kv[-1].concurrent_per_engine < 1:
        hint = smallest_rollout_tp(arch, layout, batch, rollout, compression if len(kv) > 1 else None)
    return Plan(model=model, arch=arch, layout=layout, batch=batch, learner=learner, rollout=rollout,
                micro_batch=learner_micro_batch(batch, layout, learner), stages=stages, kv=kv,
                suggestion=None if fits else suggest(arch, layout, batch, learner), rollout_tp_hint=hint,
                engines=engines)
