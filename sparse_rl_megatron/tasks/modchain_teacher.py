"""A weaker teacher for ``modchain``: headroom that supervised training cannot take and RL can.

With perfect demonstrations more supervised training is the best use of compute (docs/experiments.md, the
15-step section), so an RL experiment there measures nothing RL-specific. ``EarlyStopTeacher`` makes the
demonstrations imperfect on one class of problems (``SUBSETS``): with probability ``stop_prob`` the demonstration
stops after step ``stop_step`` and boxes ``x_stop`` instead of ``x_N``, and every such early answer is wrong
(x_stop != x_N on every problem of the class, ``check_early_answers_wrong``). What supervised training learns
from this, at the one position after step ``stop_step``:

- P(stop | class) ~ ``stop_prob`` (maximum likelihood matches the teacher), so greedy decoding stops whenever
  ``stop_prob`` > 0.5: greedy accuracy on the class ~0, and MORE supervised training only sharpens this;
- sampling at T = 1 continues with probability ~1 - ``stop_prob``, and a continued chain is right about as
  often as on the other problems, so GRPO sees reward on the class and a clear advantage for continuing.

The class must be visible to the model at that position, or it learns one unconditional stop rate for all
problems (greedy then never stops). Measured (docs/experiments.md): with the class "odd b" the 2-layer model did
not learn the condition in 300 or 1000 supervised steps (T = 1 stop rates 30% / 23% on odd / even b at 300
steps, greedy never stopped), because the decision sits at a step-marker position that does not attend to b.
The default class, ``odd_x_stop``, is read off the token just before the decision: x_stop odd, minus the
fixed-point chains (x_stop == x_N, where stopping would be right). The other problems (``rest``) are taught
perfectly: their accuracy measures what RL damages. Records carry the class as ``extra["subset"]``, so
evaluation reports accuracy per class (``eval/subsets.py``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from sparse_rl_megatron.tasks.modchain_problems import Problem, all_keys, answer_text, chain_words
from sparse_rl_megatron.utils.registry import Registry

Key = tuple[int, int, int]
OTHER = "rest"
"""The name of the perfectly taught problems in metrics."""
SUBSETS: Registry[Callable[[Problem, int, int], bool]] = Registry("modchain subset")
"""Class predicates ``(problem, steps N, stop_step) -> bool``."""
SUBSETS.add("odd_b", lambda p, n, k: p.b % 2 == 1)


def _odd_x_stop(p: Problem, n: int, k: int) -> bool:
    """x_k odd and x_k != x_N (one walk of the chain)."""
    states = p.states(n)
    return states[k - 1] % 2 == 1 and states[k - 1] != states[-1]


SUBSETS.add("odd_x_stop", _odd_x_stop)


@dataclass(frozen=True)
class EarlyStopTeacher:
    """Demonstrations that stop early on one class of problems (module docstring)."""

    subset: str = "odd_x_stop"
    """The class whose demonstrations may stop early (``SUBSETS``); the other problems are taught perfectly."""
    stop_step: int = 27
    """The demonstration's last step when it stops early (it then boxes ``x_stop_step``)."""
    stop_prob: float = 0.7
    """Probability that a demonstration of the class stops early (drawn once per training record)."""
    early_answer: bool = True
    """An early stop boxes ``x_stop`` (a wrong answer); False: it ends there without an answer. RL's negative
    advantage then lands on the stop, not on a box: a boxed early stop's digits are those of right boxes (an odd
    state's transliteration), and on one draw RL learned to box an odd final state as its even neighbour (33% of
    the answers wrong at step 150 with every chain right; docs/embedded-default.md)."""

    def __post_init__(self) -> None:
        SUBSETS.check(self.subset, "EarlyStopTeacher.subset")
        if self.stop_step < 1:
            raise ValueError(f"EarlyStopTeacher.stop_step must be >= 1, got {self.stop_step}")
        if not 0 <= self.stop_prob <= 1:
            raise ValueError(f"EarlyStopTeacher.stop_prob must be in [0, 1], got {self.stop_prob}")

    def in_class(self, problem: Problem, steps: int) -> bool:
        """Whether the teacher may stop early on ``problem`` (an N = ``steps`` chain)."""
        return SUBSETS.get(self.subset)(problem, steps, self.stop_step)

    def subset_of(self, problem: Problem, steps: int) -> str:
        """``self.subset`` or ``OTHER`` (``rest``)."""
        return self.subset if self.in_class(problem, steps) else OTHER

    def check_early_answers_wrong(self, steps: int, problems: Sequence[Problem] | None = None) -> None:
        """Raise ``ValueError`` unless ``stop_step < steps`` and every problem of the class has x_stop != x_N (an
        early answer that happened to be right would teach nothing wrong). ``problems``: the variant's problems
        (default: the 400 mod-10 chains)."""
        if not self.stop_step < steps:
            raise ValueError(f"EarlyStopTeacher.stop_step={self.stop_step} must be below the chain length {steps}")
        if problems is None:
            problems = [Problem(*k) for k in all_keys()]
        in_class = [p for p in problems if self.in_class(p, steps)]
        right = [p.key for p in in_class if (states := p.states(steps))[self.stop_step - 1] == states[-1]]
        if right:
            raise ValueError(f"EarlyStopTeacher: x_{self.stop_step} == x_{steps} on {len(right)} problems of "
                             f"'{self.subset}' (e.g. {right[0]}), so stopping there would be right; choose another "
                             f"stop_step or subset")
        if not in_class:
            raise ValueError(f"EarlyStopTeacher: no problem is in class '{self.subset}' at stop_step "
                             f"{self.stop_step}")

    def demonstration(self, problem: Problem, steps: int, rng: random.Random, restate_start: bool = False,
                      answer_format: str = "digits") -> str:
        """The teacher's worked solution of ``problem``: ``problem.solution(steps)``, or on the class with
        probability ``stop_prob`` the first ``stop_step`` steps and ``\\boxed{x_stop_step}`` (``early_answer``;
        else nothing after them). Draws from ``rng`` for every problem (of either class), so the draws do not depend
        on which problems precede. ``answer_format``: how the boxes are written (``ANSWER_FORMATS``)."""
        stop = rng.random() < self.stop_prob
        if not (stop and self.in_class(problem, steps)):
            return problem.solution(steps, restate_start, answer_format)
        states = problem.states(self.stop_step)
        box = [answer_text(states[-1], answer_format)] if self.early_answer else []
        return " ".join(chain_words(problem.x0, states, restate_start) + box)
