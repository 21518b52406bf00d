"""Rewards by name. A reward is a context manager (start workers on enter, stop them on exit) with
``score_samples(samples) -> list[Verdict]``, which also sets each sample's ``reward`` and ``reward_reason``.

- ``math``: math-verify equivalence of the final answer with the gold answer, in a process pool (``MathReward``).
- ``exact``: exact string match of the final answer with the gold answer, in-process (``ExactReward``).

Tasks built in code (``sparse_rl_megatron.tasks``) name the reward they are scored with.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from sparse_rl_megatron.rewards.exact import ExactReward
from sparse_rl_megatron.rewards.reward import MathReward
from sparse_rl_megatron.rewards.verify import Verdict
from sparse_rl_megatron.utils.registry import Registry

if TYPE_CHECKING:
    from sparse_rl_megatron.rollout.sample import Sample


class Reward(Protocol):
    def __enter__(self) -> "Reward": ...

    def __exit__(self, *exc: Any) -> None: ...

    def score_samples(self, samples: Sequence["Sample"]) -> list[Verdict]: ...


REWARDS: Registry[Callable[..., Reward]] = Registry("reward")
REWARDS.add("math", MathReward)
REWARDS.add("exact", ExactReward)
