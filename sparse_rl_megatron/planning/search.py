"""Which layouts a model allows, and the nearest layout that fits when the requested one does not."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.planning.inputs import GIB, BatchShape, Layout, LearnerSetting
from sparse_rl_megatron.planning.learner_memory import learner_memory, peak_stage

MAX_GPU_MULTIPLE = 8  # when nothing fits on the given GPUs, try up to this many times as many


def valid_tp(arch: ModelArch, gpus_per_node: int) -> list[int]:
    """TP sizes that divide the heads, the KV groups and the FFN width, within one node."""
    return [d for d in arch.tensor_parallel_sizes() if d <= gpus_per_node]


def check_layout(arch: ModelArch, layout: Layout) -> None:
    """One line naming ``--tp`` / ``--pp`` and the valid values when the model cannot be split so."""
    tps = valid_tp(arch, layout.gpus_per_node)
    if layout.tp not in tps:
        ffn = (f"intermediate_size={arch.ffn_hidden_size}" if arch.moe is None else
               f"shared_expert_intermediate_size={arch.moe.shared_expert_ffn_hidden_size}" if arch.moe.has_shared_expert
               else "")
        raise ValueError(f"--tp {layout.tp} does not divide num_attention_heads={arch.num_attention_heads}, "
                         f"num_key_value_heads={arch.num_query_groups}{' and ' + ffn if ffn else ''} "
                         f"of this model; valid --tp values: {', '.join(map(str, tps))}")
    if arch.moe is None and (layout.ep > 1 or layout.etp is not None):
        raise ValueError(f"--ep / --etp split a mixture of experts' routed experts; this {arch.family} model is dense: "
                         "valid --ep 1, no --etp")
    if arch.moe is not None and layout.ep not in arch.expert_parallel_sizes():
        raise ValueError(f"--ep {layout.ep} does not divide num_experts={arch.moe.num_experts} of this model; valid --ep "
                         f"values: {', '.join(map(str, arch.expert_parallel_sizes()))}")
    if arch.moe is not None and layout.expert_tp not in arch.expert_tensor_parallel_sizes():
        raise ValueError(f"--etp {layout.expert_tp} does not divide moe_intermediate_size={arch.moe.ffn_hidden_size}; "
                         f"valid --etp values: {', '.join(map(str, arch.expert_tensor_parallel_sizes()))}")
    if layout.pp not in arch.pipeline_parallel_sizes():
        raise ValueError(f"--pp {layout.pp} does not divide num_hidden_layers={arch.num_layers}; valid --pp values: "
                         f"{', '.join(map(str, arch.pipeline_parallel_sizes()))}")


@dataclass(frozen=True)
class Suggestion:
    layout: Layout
    setting: LearnerSetting
    peak_bytes: float

    def describe(self, base: LearnerSetting) -> str:
        changes = [self.layout.describe()]
        if self.setting.distributed_optimizer and not base.distributed_optimizer:
            changes.append("distributed optimizer on")
        if self.setting.recompute and not base.recompute:
            changes.append("full recompute")
        if self.setting.offload != base.offload:
            changes.append(f"--offload {self.setting.offload}")
        return f"{', '.join(changes)}: {self.peak_bytes / GIB:.1f} GiB per GPU"


def offload_order() -> list[str]:
    """The offload modes from the one that puts the least to sleep to the one that puts the most
    (``learner.offload.OFFLOAD_MODES``, ordered by how many parts sleep)."""
    from sparse_rl_megatron.learner.offload import OFFLOAD_MODES

    return sorted(OFFLOAD_MODES.names(), key=lambda name: len(OFFLOAD_MODES.get(name).parts))


Check = Callable[[Layout, LearnerSetting], "float | None"]
"""A candidate's peak bytes per GPU when it fits (every phase), None when it does not."""


def _candidates(arch: ModelArch, layout: Layout, gpus: int, setting: LearnerSetting):
    order = offload_order()
    offloads = order[order.index(setting.offload):]  # only more sleeping than asked
    for tp in valid_tp(arch, layout.gpus_per_node):
        for pp in arch.pipeline_parallel_sizes():
            if gpus % (tp * pp) or (gpus // pp) % (layout.ep * (tp if layout.etp is None else layout.etp)):
                continue
            lay = dataclasses.replace(layout, tp=tp, pp=pp, dp=gpus // (tp * pp))
            for distopt in sorted({setting.distributed_optimizer, True}):
                for recompute in sorted({setting.recompute, True}):
                    for offload in offloads:
                        yield lay, dataclasses.replace(setting, distributed_optimizer=distopt, recompute=recompute,
                                                       offload=offload)


def suggest(arch: ModelArch, layout: Layout, batch: BatchShape, setting: LearnerSetting,
            check: Check | None = None) -> Suggestion | None:
    """The fitting layout nearest to the requested one: the fewest changes (each switched-on memory saver counts
    1, an offload mode that puts more to sleep its steps in ``offload_order``, a TP or PP change its log2
    distance), then the most data parallelism; more GPUs (x2, x4, ...) only if none fits on the given ones.
    ``check``: whether a candidate fits (its peak bytes, or None); default: the learner's peak within the GPU."""
    budget = layout.gpu_memory_gib * GIB
    order = offload_order()

    def learner_only(lay: Layout, sett: LearnerSetting) -> float | None:
        peak = peak_stage(learner_memory(arch, lay, batch, sett), sett).total(sett)
        return peak if peak <= budget else None

    check = check or learner_only
    multiple = 1
    while multiple <= MAX_GPU_MULTIPLE:
        best = None
        for lay, sett in _candidates(arch, layout, layout.gpus * multiple, setting):
            if check is not learner_only and learner_only(lay, sett) is None:
                continue  # the learner alone does not fit: no ledger to build
            peak = check(lay, sett)
            if peak is None:
                continue
            switched = (sett.recompute != setting.recompute) + (sett.distributed_optimizer != setting.distributed_optimizer)
            switched += order.index(sett.offload) - order.index(setting.offload)
            distance = abs(math.log2(lay.tp / layout.tp)) + abs(math.log2(lay.pp / layout.pp))
            key = (switched + distance, lay.tp * lay.pp, peak)
            if best is None or key < best[0]:
                best = (key, Suggestion(lay, sett, peak))
        if best is not None:
            return best[1]
        multiple *= 2
    return None
