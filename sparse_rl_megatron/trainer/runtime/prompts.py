"""The order in which training problems are visited, as a position that a checkpoint saves and resume restores.

Epoch ``e`` visits every problem once, in a permutation drawn from ``(seed, e)`` (or in file order without
shuffling); the position is the number of problems handed out so far. The order therefore depends only on
``(seed, number of problems, consumed)``: a resumed run takes exactly the prompts the uninterrupted run would
have taken, and no problem is replayed or skipped.
"""
from __future__ import annotations

import random
from typing import Any, Sequence, TypeVar

T = TypeVar("T")


class PromptOrder:
    """Hands out problems of ``records`` in the resumable order described above."""

    def __init__(self, records: Sequence[T], seed: int, shuffle: bool = True, consumed: int = 0):
        if not records:
            raise ValueError("PromptOrder needs at least one problem")
        self.records = records
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = consumed
        self._epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._perm = list(range(len(self.records)))
            if self.shuffle:
                random.Random(f"prompt-order/{self.seed}/{epoch}").shuffle(self._perm)
            self._epoch = epoch
        return self._perm

    def take(self, count: int) -> list[T]:
        """The next ``count`` problems (wrapping into the next epoch as needed)."""
        out = []
        for _ in range(count):
            epoch, pos = divmod(self.consumed, len(self.records))
            out.append(self.records[self._permutation(epoch)[pos]])
            self.consumed += 1
        return out

    @property
    def epoch(self) -> float:
        """Fractional epochs consumed."""
        return self.consumed / len(self.records)

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "num_records": len(self.records), "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Restore the position; returns warnings (a data set of another size means another order)."""
        warnings = []
        if state.get("num_records") != len(self.records):
            warnings.append(f"the data set now has {len(self.records)} problems, the checkpoint's had "
                            f"{state.get('num_records')}: the prompt order differs from the interrupted run's")
        if state.get("seed") != self.seed or state.get("shuffle") != self.shuffle:
            warnings.append("the seed or data.shuffle changed since the checkpoint: the prompt order differs")
        self.consumed = int(state["consumed"])
        return warnings
