"""How repetitive sampled responses are: the fraction of a response's n-grams that repeat an earlier n-gram of
the same response (0 for a response without repeats; close to 1 for a loop such as ``a b a b a b ...``).

Collapsed policies (the paper's naive sparse rollouts) turn repetitive; a healthy chain of thought whose
steps carry a step marker (``modchain``: ``sOne x sTwo y ...``) has no repeated 4-gram at all.
"""
from __future__ import annotations

from typing import Sequence

from sparse_rl_megatron.observability import metric_names as MN

REPETITION_NGRAM = 4
"""n of the repeated-n-gram fraction (token n-grams)."""


def repeated_ngram_frac(tokens: Sequence[int], n: int = REPETITION_NGRAM) -> float:
    """Fraction of the ``len(tokens) - n + 1`` n-grams of ``tokens`` seen earlier in ``tokens`` (0 when shorter
    than n)."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(total):
        gram = tuple(tokens[i:i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats / total


def repetition_metrics(samples: Sequence) -> dict[str, float]:
    """``rollout/repetition_rate``: the mean repeated-4-gram fraction of the samples' responses (``response_ids``)."""
    if not samples:
        return {}
    return {MN.ROLLOUT_REPETITION_RATE: sum(repeated_ngram_frac(list(s.response_ids)) for s in samples) / len(samples)}
