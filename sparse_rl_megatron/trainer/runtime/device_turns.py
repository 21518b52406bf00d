"""Who holds the GPUs of a colocated run, phase by phase: the engines, the learner, or both for a weight push.

The turns and what each needs on the device are ``learner/turns.py``'s table. A turn is entered by name from any
other (entering the one held does nothing), so each phase states what it needs and the order of phases can change
without a memory bug. Memory is freed on one side before the other side takes it: learners sleep and engines release
first, then learners wake and engines resume. Released engine weights come back undefined on a GPU (SGLang's memory
saver keeps no copy): after a turn that released them, only ``sync`` (whose caller pushes the weights) may give the
engines their weights back. ``learner.offload: none`` still turns the engines' memory; the learner then stays awake.

At start-up the learners are built awake; ``start_engines`` puts them to sleep before the engines are created, so
each engine sizes its KV pool from what the sleeping learner leaves free.
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol, Sequence, TypeVar

from sparse_rl_megatron.learner.offload import OFFLOAD_PARTS
from sparse_rl_megatron.learner.turns import ENGINE_PARTS, TURNS, Turn


class EngineMemory(Protocol):
    """What of the engines a turn moves (``EnginePool``: every engine of the run)."""

    def release_memory(self, parts: Sequence[str] = ...) -> None: ...

    def resume_memory(self, parts: Sequence[str] = ...) -> None: ...


Pool = TypeVar("Pool", bound=EngineMemory)


class LearnerMemory(Protocol):
    """What of a learner a turn moves (``Learner``)."""

    @property
    def asleep_parts(self) -> frozenset[str]: ...

    def sleep(self, parts: Iterable[str] | None = None) -> dict[str, int]: ...

    def wake(self, parts: Iterable[str] | None = None) -> None: ...


class DeviceTurns:
    """The turn the GPUs are in; ``enter(turn)`` moves the learners and the engines' memory to it."""

    def __init__(self, policy: LearnerMemory | None, reference: LearnerMemory | None = None):
        self.learners: list[tuple[LearnerMemory, str]] = [(lrn, role) for lrn, role in ((policy, "policy"),
                                                                                  (reference, "reference"))
                                                    if lrn is not None]
        self.pool: EngineMemory | None = None
        self.turn: Turn = "train"  # built awake
        self.engine_parts: set[str] = set()
        """The engines' parts resumed (none before they exist). Weights missing here were released since their last
        push: only ``sync``, whose caller pushes them, may take them back."""

    def start_engines(self, start: Callable[[], Pool]) -> Pool:
        """Put the learners to sleep, then build the engines (``start()``): they hold the GPU from here on."""
        for learner, _ in self.learners:
            learner.sleep()
        self.pool = start()
        self.turn = "engines"
        self.engine_parts = set(ENGINE_PARTS)
        return self.pool

    def enter(self, turn: Turn) -> None:
        """Move to ``turn``; memory is always freed on one side before the other takes it."""
        needs = TURNS.get(turn)
        if needs is None:
            raise ValueError(f"DeviceTurns.enter: unknown turn {turn!r}; valid: {', '.join(TURNS)}")
        if turn == self.turn:
            return
        if self.pool is not None and "weights" in needs.engines and "weights" not in self.engine_parts \
                and turn != "sync":
            raise RuntimeError(f"DeviceTurns: the engines' weights were released for the learner; enter the sync "
                               f"turn and push the weights before the {turn} turn")
        pool = self.pool
        # free: learners' parts not needed go to sleep, engines' parts not needed are released
        for learner, role in self.learners:
            keep = needs.policy if role == "policy" else needs.reference
            learner.sleep([p for p in OFFLOAD_PARTS if p not in keep])
        release = [p for p in ENGINE_PARTS if p in self.engine_parts and p not in needs.engines]
        if release and pool is not None:
            pool.release_memory(release)
            self.engine_parts -= set(release)
        # take: learners' parts needed wake, engines' parts needed resume
        for learner, role in self.learners:
            keep = needs.policy if role == "policy" else needs.reference
            learner.wake(keep)
        resume = [p for p in ENGINE_PARTS if p in needs.engines and p not in self.engine_parts]
        if resume and pool is not None:
            pool.resume_memory(resume)
            self.engine_parts |= set(resume)
        self.turn = turn
