"""What each turn of a colocated step needs on the device: the table the run follows (``trainer/runtime/
device_turns.py``) and the planner adds up (``planning/phases.py``).

Every GPU recipe puts a learner rank and a rollout engine on each GPU; they take turns. Each turn names what must be
on the device; everything else that may sleep sleeps (the learner's parts as far as ``learner.offload`` lets them,
``learner/offload.py``; the engines' parts with SGLang's memory saver):

| turn | phases | engines | policy (learner) | KL reference |
|---|---|---|---|---|
| ``engines`` | rollout, evaluation | weights + KV pool | - | - |
| ``recompute`` | dense old log-probs, reference log-probs | - | weights | weights |
| ``train`` | optimizer steps, checkpoint save and load | - | weights, gradients, optimizer | - |
| ``sync`` | weight push, the probe's learner side | weights | weights | - |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sparse_rl_megatron.learner.offload import OFFLOAD_PARTS

Turn = Literal["engines", "recompute", "train", "sync"]
ENGINE_PARTS: tuple[str, ...] = ("weights", "kv_cache")
"""The engines' memory parts (``rollout.engine_protocol.ENGINE_MEMORY_PARTS``, which a test keeps equal)."""


@dataclass(frozen=True)
class TurnNeeds:
    """What one turn needs on the device."""

    engines: tuple[str, ...]
    """The engines' memory parts resumed (of ``ENGINE_PARTS``)."""
    policy: tuple[str, ...]
    """The policy learner's parts awake (of ``learner.offload.OFFLOAD_PARTS``)."""
    reference: tuple[str, ...]
    """The KL reference's parts awake (it has weights only)."""


TURNS: dict[str, TurnNeeds] = {
    "engines": TurnNeeds(engines=ENGINE_PARTS, policy=(), reference=()),
    "recompute": TurnNeeds(engines=(), policy=("weights",), reference=("weights",)),
    "train": TurnNeeds(engines=(), policy=OFFLOAD_PARTS, reference=()),
    "sync": TurnNeeds(engines=("weights",), policy=("weights",), reference=()),
}
"""Each turn's needs, in the order of a step."""
