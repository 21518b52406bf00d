"""The binary math reward of Sparse-RL: 1 if the response's final answer equals the gold answer, else 0.

``MathReward`` owns a ``VerifierPool`` (start it once per run: workers are long-lived) and scores either
plain ``(response, gold, style)`` triples or rollout ``Sample``s whose ``metadata`` carries the gold answer
(``MathRecord.metadata()``: ``gold_answer``, ``answer_style``).
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

from sparse_rl_megatron.rewards.pool import VerifierPool, VerifierPoolConfig
from sparse_rl_megatron.rewards.verify import REASONS, Verdict

if TYPE_CHECKING:  # no torch import in the worker-side package
    from sparse_rl_megatron.rollout.sample import Sample


class SampleReward:
    """What every reward shares: ``score(responses, golds, styles)`` (subclasses), ``score_samples``, and the
    context-manager form over ``start``/``close`` (nothing to start or close unless a subclass says so)."""

    def start(self) -> "SampleReward":
        return self

    def close(self) -> None:
        pass

    def __enter__(self) -> "SampleReward":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def score(self, responses: Sequence[str], golds: Sequence[str], styles: Sequence[str] | str = "boxed"
              ) -> list[Verdict]:
        raise NotImplementedError

    def score_samples(self, samples: Sequence["Sample"]) -> list[Verdict]:
        """Set ``reward``, ``reward_reason`` and ``metadata['extracted_answer']`` of each sample."""
        golds, styles = [], []
        for i, s in enumerate(samples):
            if s.metadata.get("gold_answer") is None:
                raise ValueError(
                    f"sample {i} has no metadata['gold_answer']; attach MathRecord.metadata() to the samples"
                )
            golds.append(str(s.metadata["gold_answer"]))
            styles.append(s.metadata.get("answer_style", "boxed"))
        verdicts = self.score([s.response_text for s in samples], golds, styles)
        for s, v in zip(samples, verdicts):
            s.reward, s.reward_reason = v.reward, v.reason
            s.metadata["extracted_answer"] = v.answer
        return verdicts


def per_response_styles(responses: Sequence[str], golds: Sequence[str], styles: Sequence[str] | str) -> list[str]:
    """One answer style per response (``styles``: one for all, or one each); lengths checked."""
    if len(responses) != len(golds):
        raise ValueError(f"score: {len(responses)} responses but {len(golds)} gold answers")
    if isinstance(styles, str):
        styles = [styles] * len(responses)
    if len(styles) != len(responses):
        raise ValueError(f"score: {len(responses)} responses but {len(styles)} answer styles")
    return list(styles)


class MathReward(SampleReward):
    """Verify answers in a process pool; never raises for a bad answer (see ``Verdict.reason``)."""

    def __init__(self, config: VerifierPoolConfig | None = None):
        self.pool = VerifierPool(config)

    def start(self) -> "MathReward":
        self.pool.start()
        return self

    def close(self) -> None:
        self.pool.close()

    def score(self, responses: Sequence[str], golds: Sequence[str], styles: Sequence[str] | str = "boxed"
              ) -> list[Verdict]:
        """One verdict per response. ``styles``: one answer style for all, or one per response."""
        styles = per_response_styles(responses, golds, styles)
        return self.pool.check(list(zip(responses, golds, styles)))


def reason_counts(verdicts: Sequence[Verdict]) -> dict[str, int]:
    """How many verdicts have each reason (every reason listed, zeros included)."""
    counts = Counter(v.reason for v in verdicts)
    return {r: counts.get(r, 0) for r in REASONS}
