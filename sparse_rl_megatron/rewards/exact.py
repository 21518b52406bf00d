"""The ``exact`` reward: 1 if the response's final answer is exactly the gold answer, else 0.

For tasks built in code (``sparse_rl_megatron.tasks``), whose answers have one canonical spelling: no
math-verify, no process pool, microseconds per check. The final answer is found by the sample's answer style
(``extract.extract_answer``: the last ``\\boxed{}`` for ``boxed``) and compared as a string with the gold
answer, surrounding whitespace and unescaped ``$`` removed from both (``verify.normalize_gold``).
Reasons: ``correct``, ``wrong``, ``no_answer`` (nothing extracted).
"""
from __future__ import annotations

from typing import Sequence

from sparse_rl_megatron.rewards.extract import extract_answer
from sparse_rl_megatron.rewards.reward import SampleReward, per_response_styles
from sparse_rl_megatron.rewards.verify import Verdict, normalize_gold


def exact_verdict(response: str, gold: str, style: str = "boxed") -> Verdict:
    """The verdict for one response."""
    answer = extract_answer(response, style)
    if answer is None or not answer.strip():
        return Verdict(0.0, "no_answer", answer)
    ok = normalize_gold(answer) == normalize_gold(gold)
    return Verdict(1.0 if ok else 0.0, "correct" if ok else "wrong", answer)


class ExactReward(SampleReward):
    """Exact string match of the final answer; in-process (entering and leaving the context do nothing)."""

    def score(self, responses: Sequence[str], golds: Sequence[str], styles: Sequence[str] | str = "boxed"
              ) -> list[Verdict]:
        """One verdict per response. ``styles``: one answer style for all, or one per response."""
        styles = per_response_styles(responses, golds, styles)
        return [exact_verdict(r, g, s) for r, g, s in zip(responses, golds, styles)]
