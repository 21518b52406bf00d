"""A whole plan: learner memory per stage, the rollout KV budget dense vs compressed (the pool sized after the
learner went to sleep), the per-GPU ledger of each phase of a step, and a suggestion when something does not fit."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.planning.activations import MicroBatchShape
from sparse_rl_megatron.planning.inputs import GIB, BatchShape, Layout, LearnerSetting, RolloutSetting
from sparse_rl_megatron.planning.kv import RolloutKV, engine_layout, rollout_kv, smallest_rollout_tp
from sparse_rl_megatron.planning.learner_memory import StageMemory, learner_memory, learner_micro_batch, peak_stage
from sparse_rl_megatron.planning.params import activated_params, total_params
from sparse_rl_megatron.planning.phases import Ledger, phase_ledger, resident_asleep
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
    micro_batch: MicroBatchShape
    stages: list[StageMemory]
    kv: list[RolloutKV]
    """Dense first, then the compressed setting (when one was given)."""
    suggestion: Suggestion | None
    """The nearest fitting layout when this one does not fit (None when it fits, or nothing does)."""
    rollout_tp_hint: int | None = None
    """The smallest rollout TP at which a sequence fits, when none fits at the given one."""
    engines: "RolloutLayout | None" = None
    """The rollout engines ``sparse-rl train`` starts on this layout (the line it prints)."""
    ledger: Ledger | None = None
    """Every phase of a step on one GPU (the run's KV setting: the last of ``kv``)."""
    resident: float = 0.0
    """What the sleeping learner (and reference) keep on a GPU when the engines start (bytes)."""

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
    def phases_fit(self) -> bool:
        """Every phase of a step fits the GPU (and the rollout pool holds a sequence)."""
        return self.ledger is None or self.ledger.fits

    @property
    def all_fit(self) -> bool:
        return self.fits and self.rollout_fits and self.phases_fit

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
    resident = resident_asleep(stages, learner)
    kv = [rollout_kv(arch, layout, batch, rollout, resident=resident)]
    if compression is not None and not compression.is_dense:
        label = f"{compression.method} B={compression.budget} W={compression.buffer}"
        if mean_budget is not None:
            mean = dataclasses.replace(compression, budget=mean_budget)
            kv.append(rollout_kv(arch, layout, batch, rollout, mean,
                                 label=f"{mean.method} B={mean.budget} W={mean.buffer} (mean)", resident=resident))
            label += " (B_max)"
        kv.append(rollout_kv(arch, layout, batch, rollout, compression, label=label, resident=resident))
    run_compression = compression if len(kv) > 1 else None
    ledger = phase_ledger(arch, layout, batch, learner, rollout, stages, kv[-1])
    fits = peak_stage(stages, learner).total(learner) <= layout.gpu_memory_gib * GIB
    hint = None
    if kv[-1].concurrent_per_engine < 1:
        hint = smallest_rollout_tp(arch, layout, batch, rollout, run_compression, resident=resident)
    suggestion = None
    if not fits or not ledger.fits:
        suggestion = suggest(arch, layout, batch, learner, check=lambda lay, sett: _ledger_peak(
            arch, lay, batch, sett, rollout, run_compression))
    return Plan(model=model, arch=arch, layout=layout, batch=batch, learner=learner, rollout=rollout,
                micro_batch=learner_micro_batch(batch, layout, learner), stages=stages, kv=kv,
                suggestion=suggestion, rollout_tp_hint=hint, engines=engines, ledger=ledger, resident=resident)


def ledger_of(arch: ModelArch, layout: Layout, batch: BatchShape, learner: LearnerSetting, rollout: RolloutSetting,
              compression=None) -> Ledger:
    """The per-phase ledger of one layout and setting (``compression`` None: dense rollouts)."""
    stages = learner_memory(arch, layout, batch, learner)
    label = "dense" if compression is None else compression.method
    kv = rollout_kv(arch, layout, batch, rollout, compression, label=label, resident=resident_asleep(stages, learner))
    return phase_ledger(arch, layout, batch, learner, rollout, stages, kv)


def _ledger_peak(arch, layout, batch, learner, rollout, compression) -> float | None:
    """A candidate's learner peak when every phase fits, else None (``search.suggest``'s check)."""
    if layout.gpus % min(layout.gpus, layout.gpus_per_node) or min(layout.gpus, layout.gpus_per_node) % rollout.tp:
        return None
    stages = learner_memory(arch, layout, batch, learner)
    ledger = ledger_of(arch, layout, batch, learner, rollout, compression)
    return peak_stage(stages, learner).total(learner) if ledger.fits else None
