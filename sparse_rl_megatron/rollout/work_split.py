"""How a step's GRPO groups (or evaluation problems) are shared out over the rollout engines.

A group never splits: its n samples share one prompt (prefilled once, in the radix cache) and its advantage
baseline. Groups go to engines by expected tokens, largest first, each to the engine with the least expected
work so far (ties: fewer groups, then the lower engine index), the greedy longest-processing-time rule; each
engine then samples its groups in global order. Deterministic (the same split on every rank), and the samples
do not depend on it: each keeps its global group id, which seeds it (``rollout.sampling.sample_seed``).
"""
from __future__ import annotations

from typing import Sequence


def group_cost(prompt_tokens: int, n: int, response_tokens: int) -> float:
    """Expected tokens of one group: its prompt (prefilled once) plus n responses of ``response_tokens``."""
    return float(prompt_tokens + n * response_tokens)


def split_groups(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Indices of ``costs`` shared out over ``parts`` engines (see the module docstring); part k ascending.

    With equal costs the parts get ``len(costs) // parts`` or one more each (engines past the groups get none).
    """
    if parts < 1:
        raise ValueError(f"split_groups: parts must be >= 1, got {parts}")
    load = [0.0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for g in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        k = min(range(parts), key=lambda j: (load[j], len(shares[j]), j))
        load[k] += costs[g]
        shares[k].append(g)
    return [sorted(share) for share in shares]


def describe_counts(counts: Sequence[int]) -> str:
    """``16 per engine``, ``3-4 per engine``, or with idle engines ``0-1 per engine (2 engines idle)``."""
    low, high = min(counts), max(counts)
    text = f"{low} per engine" if low == high else f"{low}-{high} per engine"
    idle = sum(c == 0 for c in counts)
    return text + (f" ({idle} engine{'s' if idle > 1 else ''} idle)" if idle else "")
