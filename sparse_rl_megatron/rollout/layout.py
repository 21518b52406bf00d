"""Where a run's rollout engines are: one object that ``sparse-rl plan``, ``sparse-rl preflight``, the recipes'
``launch.layout`` and the trainer's start-up line all print, and that the trainer starts.

- **colocated** (no ``rollout.sglang.urls``): one engine per group of ``gpus_per_engine`` consecutive ranks, on
  every node, in the group's first rank; on GPUs it uses the group's GPUs (SGLang ``base_gpu_id`` = that rank's
  local rank, ``tp_size`` = ``gpus_per_engine``) and shares them with the learner. A group never spans nodes.
- **servers** (``rollout.sglang.urls``): one engine per URL, on its own nodes; engine k is driven (requests,
  weights, reward) by rank ``k * world // engines`` (several engines per rank when there are more URLs than
  ranks), so the drivers spread over the nodes.

Light to import (no torch): the planner and the launch checks use it before anything is installed or started.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sparse_rl_megatron.rollout.work_split import describe_counts, split_groups

MAX_URLS_SHOWN = 2


class LayoutError(ValueError):
    """A rollout layout that cannot start; the message names the option and the valid values."""


@dataclass(frozen=True)
class EngineSlot:
    """One rollout engine of the run."""

    index: int
    """Engine number (0 ..): the order of the work split."""
    rank: int
    """Global rank that drives it (builds it, sends its requests and weights, scores its samples)."""
    ranks: tuple[int, ...]
    """Learner ranks whose GPUs it uses (colocated; ``()`` for a server on its own nodes)."""
    node: int
    """Node (torchrun agent) of the driving rank."""
    gpus: tuple[int, ...] = ()
    """Local GPU indices it runs on (colocated on GPUs; ``()`` on CPU or for a server)."""
    url: str | None = None
    """Base URL of the server (servers only)."""

    @property
    def base_gpu_id(self) -> int:
        """SGLang's ``base_gpu_id``: the first of its GPUs (0 without GPUs)."""
        return self.gpus[0] if self.gpus else 0


def _span(values: Sequence[int]) -> str:
    """``0-7``, ``0,2,4,6``, ``0-62 step 2``, ``3``."""
    values = list(values)
    if len(values) == 1:
        return str(values[0])
    steps = {b - a for a, b in zip(values, values[1:])}
    if steps == {1}:
        return f"{values[0]}-{values[-1]}"
    if len(steps) == 1 and len(values) > 4:
        return f"{values[0]}-{values[-1]} step {steps.pop()}"
    return ",".join(map(str, values))


@dataclass(frozen=True)
class RolloutLayout:
    """The engines of a run (see the module docstring); build it with :meth:`build`."""

    engine: str
    """``rollout.engine``."""
    world: int
    ranks_per_node: int
    gpus_per_engine: int
    """``rollout.gpus_per_engine``: the engines' tensor-parallel size (colocated: ranks per engine)."""
    slots: tuple[EngineSlot, ...]
    groups: int
    """GRPO groups per step (``rollout.prompts_per_step``)."""
    on_gpu: bool
    tensor_parallel: bool = True
    """Whether the engine kind shards itself over its GPUs (SGLang); the HF engine runs on one device."""

    @classmethod
    def build(cls, *, engine: str, world: int, ranks_per_node: int, gpus_per_engine: int, groups: int,
              urls: Sequence[str] = (), on_gpu: bool = False, tensor_parallel: bool = True) -> "RolloutLayout":
        """The layout of ``world`` ranks (``ranks_per_node`` per node); raises ``LayoutError`` if it cannot start."""
        g = gpus_per_engine
        if g < 1:
            raise LayoutError(f"rollout.gpus_per_engine must be >= 1, got {g}")
        if ranks_per_node < 1 or world % ranks_per_node:
            raise LayoutError(f"{ranks_per_node} ranks per node do not divide the world size {world}")
        if urls:
            engines = len(urls)
            slots = []
            for k, url in enumerate(urls):
                rank = k * world // engines if engines <= world else k % world
                slots.append(EngineSlot(k, rank, (), rank // ranks_per_node, (), url))
        else:
            if ranks_per_node % g:
                valid = [d for d in range(1, ranks_per_node + 1) if ranks_per_node % d == 0]
                raise LayoutError(
                    f"rollout.gpus_per_engine={g} must divide the {ranks_per_node} rank(s) per node (an engine's GPUs "
                    f"are on one node); valid: {', '.join(map(str, valid))}")
            slots = []
            for k in range(world // g):
                first = k * g
                local = first % ranks_per_node
                slots.append(EngineSlot(k, first, tuple(range(first, first + g)), first // ranks_per_node,
                                        tuple(range(local, local + g)) if on_gpu else ()))
        return cls(engine=engine, world=world, ranks_per_node=ranks_per_node, gpus_per_engine=g, slots=tuple(slots),
                   groups=groups, on_gpu=on_gpu, tensor_parallel=tensor_parallel)

    # ------------------------------------------------------------------------------------------- queries
    @property
    def num_engines(self) -> int:
        return len(self.slots)

    @property
    def servers(self) -> bool:
        """Engines on their own nodes (``rollout.sglang.urls``)."""
        return any(s.url for s in self.slots)

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def slots_of(self, rank: int) -> tuple[EngineSlot, ...]:
        """The engines ``rank`` drives (none, one, or several servers)."""
        return tuple(s for s in self.slots if s.rank == rank)

    def group_counts(self) -> list[int]:
        """Groups per engine in a step of equal-cost groups."""
        return [len(share) for share in split_groups([1.0] * self.groups, self.num_engines)]

    # ----------------------------------------------------------------------------------------- describe
    def describe(self) -> str:
        """One line: what starts, e.g. ``rollout: 8 sglang engines x TP1 on ranks 0-7 (GPUs 0-7), 128 groups ->
        16 per engine``."""
        e, g = self.num_engines, self.gpus_per_engine
        kind = f"{e} {self.engine} {'server' if self.servers else 'engine'}{'s' if e > 1 else ''}"
        if self.tensor_parallel:
            kind += f" x TP{g}"
        drivers = _span(sorted({s.rank for s in self.slots}))
        rank_word = "rank" if len({s.rank for s in self.slots}) == 1 else "ranks"
        if self.servers:
            urls = [s.url for s in self.slots]
            shown = ", ".join(urls) if len(urls) <= MAX_URLS_SHOWN else f"{len(urls)} URLs ({urls[0]} ... {urls[-1]})"
            where = f"at {shown}, driven by {rank_word} {drivers}"
        else:
            if self.on_gpu:
                local = [s.gpus for s in self.slots if s.node == 0]
                gpus = "GPUs " + (_span([x for grp in local for x in grp]) if g == 1 or not self.tensor_parallel
                                  else ", ".join(_span(grp) for grp in local))
                place = f"{self.nodes} nodes x {gpus}" if self.nodes > 1 else gpus
            else:
                place = "CPU"
            if g > 1 and not self.tensor_parallel:
                place = f"one per {g} ranks, {place}"
            where = f"on {rank_word} {drivers} ({place})"
        return f"rollout: {kind} {where}, {self.groups} groups -> {describe_counts(self.group_counts())}"
