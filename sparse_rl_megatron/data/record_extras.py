"""The ``MathRecord.extra`` fields a task built in code fills and evaluation reads (``eval/subsets.py``,
``tasks/warm_check.py``): a record's class, whether its answer is free of shortcuts, its worked chain."""
from __future__ import annotations

SUBSET_KEY = "subset"
"""The field naming a record's class (e.g. a weaker teacher's class and the rest)."""
SHORTCUT_FREE_KEY = "shortcut_free"
"""The flag of a record whose answer is none of the values named in its prompt."""
CHAIN_KEY = "chain"
"""A chain task's worked chain: every intermediate state, words separated by spaces, without the final answer."""


def full_chain(response: str, chain: str) -> bool:
    """Whether ``response`` opens with every word of ``chain`` (whitespace aside): all intermediate states right."""
    words = chain.split()
    return response.split()[:len(words)] == words
