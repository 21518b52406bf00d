"""What of the learner stays on each GPU while it sleeps (``learner.offload``), part by part.

The parts are ``learner.offload.OFFLOAD_PARTS`` (weights, gradients, optimizer) and the figures are the learner
table's (``learner_memory``): weights ``e N``, fp32 main gradients ``4 N``, optimizer state (fp32 master weights
and Adam moments, ``12 N`` for bf16 parameters, ``8 N`` for fp32 ones; the distributed optimizer's shards when it
is on). A part the offload mode puts to sleep keeps 0 bytes; a frozen KL reference policy's weights sleep with the
learner's weights (``learner/offload.py``: the ``weights`` part covers a reference policy's too).

``learner_resident_bytes`` is the planner's side of the comparison with a real learner's ``resident_bytes()``
(same keys). What it does not count: megatron's DDP pads each gradient/parameter bucket (to a multiple of the DP
size, x 128 with the distributed optimizer), and Adam creates its moments at the first step (before it, a bf16
learner's optimizer holds only the fp32 master weights, ``4 N``; an fp32 learner's nothing of its own).
"""
from __future__ import annotations

from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.planning.inputs import BatchShape, Layout, LearnerSetting
from sparse_rl_megatron.planning.learner_memory import StageMemory, learner_memory

_STATIC_ONLY = BatchShape(1, 1, 1, 1)  # the static figures do not depend on the batch


def sleeping_parts(setting: LearnerSetting) -> frozenset[str]:
    """The parts ``setting.offload`` puts to sleep."""
    from sparse_rl_megatron.learner.offload import offload_parts

    return offload_parts(setting.offload)


def stage_parts(stage: StageMemory, setting: LearnerSetting) -> dict[str, int]:
    """Every part's bytes on one GPU of ``stage`` with the learner awake (``OFFLOAD_PARTS`` order)."""
    optimizer = stage.optimizer_distributed if setting.distributed_optimizer else stage.optimizer
    return {"weights": int(stage.weights), "gradients": int(stage.gradients), "optimizer": int(optimizer)}


def resident_parts(stage: StageMemory, setting: LearnerSetting, *, asleep: bool = True) -> dict[str, int]:
    """``stage_parts`` with the parts ``setting.offload`` puts to sleep at 0 when ``asleep``."""
    gone = sleeping_parts(setting) if asleep else frozenset()
    return {part: 0 if part in gone else n for part, n in stage_parts(stage, setting).items()}


def reference_resident(stage: StageMemory, setting: LearnerSetting, *, asleep: bool = True) -> int:
    """A KL reference policy's weights on one GPU of ``stage`` (0 without one, or asleep with the weights)."""
    if asleep and "weights" in sleeping_parts(setting):
        return 0
    return int(stage.reference)


def learner_resident_bytes(arch: ModelArch, layout: Layout, setting: LearnerSetting, *, stage: int = 0,
                           asleep: bool = True) -> dict[str, int]:
    """Device bytes of each learner part (``weights``, ``gradients``, ``optimizer``) on one GPU of pipeline stage
    ``stage`` for the offload mode ``setting.offload``: asleep (``asleep=True``, what stays while the engines
    decode) or awake. The KL reference policy is not included (``reference_resident``)."""
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage must be in [0, {layout.pp}) for PP {layout.pp}, got {stage}")
    stages = learner_memory(arch, layout, _STATIC_ONLY, setting)
    return resident_parts(stages[stage], setting, asleep=asleep)
