"""Accuracy per class of problems, for tasks whose records name their class (``MathRecord.extra["subset"]``).

A task with a weaker teacher on one class (``tasks/modchain_teacher.py``) needs that class's accuracy (what RL
learns) apart from the other's (what it damages); a data set without ``subset`` fields gives no metrics.

Shortcut-free accuracy: the accuracy on the records whose answer cannot be copied from the prompt (a task marks
them ``MathRecord.extra["shortcut_free"]``; ``tasks/audit.py``), so a policy that boxes a prompt value scores 0
there. On ``modchain_weak`` the overall accuracy rose under RL while this one fell (docs/embedded-default.md).

Full chains: for chain tasks (records carry their worked chain, every intermediate state without the final answer,
as ``MathRecord.extra["chain"]``), the share of responses that write that whole chain, every state right: an answer
reached through a wrong state, or a chain stopped early, does not count.
"""
from __future__ import annotations

from typing import Any

from sparse_rl_megatron.data.loader import Dataset
from sparse_rl_megatron.data.record_extras import CHAIN_KEY, SHORTCUT_FREE_KEY, SUBSET_KEY, full_chain
from sparse_rl_megatron.observability import metric_names as MN


def full_chain_fraction(dataset: Dataset, problems: list[dict[str, Any]]) -> tuple[float, int] | None:
    """(mean over the records with a chain of the share of samples that write it in full, number of such records)
    of one evaluation (``problems`` in the data set's order, each with ``samples`` carrying ``response``); None
    when no record of ``dataset`` carries a chain."""
    if len(problems) != len(dataset):
        raise ValueError(f"{len(problems)} evaluated problems for {len(dataset)} records")
    pairs = [(r.extra[CHAIN_KEY], p) for r, p in zip(dataset, problems) if CHAIN_KEY in r.extra]
    if not pairs:
        return None
    shares = [sum(full_chain(s["response"], chain) for s in p["samples"]) / len(p["samples"]) for chain, p in pairs]
    return sum(shares) / len(shares), len(shares)


def subset_metrics(prefix: str, dataset: Dataset, section: dict[str, Any]) -> dict[str, float]:
    """``<prefix>/subset_<name>/accuracy`` (mean over the class's problems of the share of correct samples),
    ``.../response_len`` (mean response tokens) and ``.../problems`` for each class of ``dataset``, from its
    ``evaluate_benchmark`` section (whose problems are in the data set's order)."""
    problems = section["problems"]
    if len(problems) != len(dataset):
        raise ValueError(f"{prefix}: {len(problems)} evaluated problems for {len(dataset)} records")
    groups: dict[str, list[dict]] = {}
    for record, problem in zip(dataset, problems):
        name = record.extra.get(SUBSET_KEY)
        if name is not None:
            groups.setdefault(str(name), []).append(problem)
    out: dict[str, float] = {}
    for name, group in sorted(groups.items()):
        samples = [s for p in group for s in p["samples"]]
        key = f"{prefix}/{MN.SUBSET_PREFIX}{name}"
        out[f"{key}/{MN.ACCURACY}"] = sum(p["correct"] / len(p["samples"]) for p in group) / len(group)
        out[f"{key}/{MN.RESPONSE_LEN}"] = sum(s["response_tokens"] for s in samples) / len(samples)
        out[f"{key}/{MN.PROBLEMS}"] = float(len(group))
    return out


def shortcut_free_accuracy(dataset: Dataset, problems: list[dict[str, Any]]) -> tuple[float, int] | None:
    """(mean over the flagged problems of the share of correct samples, number of flagged problems) of one
    evaluation (``problems`` in the data set's order, each with ``correct`` and ``samples``); None when no record of
    ``dataset`` carries the flag (the accuracy is nan when the flag is present but no record has it set)."""
    if len(problems) != len(dataset):
        raise ValueError(f"{len(problems)} evaluated problems for {len(dataset)} records")
    if not any(SHORTCUT_FREE_KEY in r.extra for r in dataset):
        return None
    free = [p for r, p in zip(dataset, problems) if r.extra.get(SHORTCUT_FREE_KEY)]
    acc = sum(p["correct"] / len(p["samples"]) for p in free) / len(free) if free else float("nan")
    return acc, len(free)


def shortcut_free_metrics(prefix: str, dataset: Dataset, section: dict[str, Any]) -> dict[str, float]:
    """``<prefix>/shortcut_free_accuracy`` (mean over the flagged problems of the share of correct samples) and
    ``<prefix>/shortcut_free_problems``; empty when no record of ``dataset`` carries the flag."""
    try:
        free = shortcut_free_accuracy(dataset, section["problems"])
    except ValueError as err:
        raise ValueError(f"{prefix}: {err}") from None
    if free is None:
        return {}
    return {f"{prefix}/{MN.SHORTCUT_FREE_ACCURACY}": free[0], f"{prefix}/{MN.SHORTCUT_FREE_PROBLEMS}": float(free[1])}


def full_chain_metrics(prefix: str, dataset: Dataset, section: dict[str, Any]) -> dict[str, float]:
    """``<prefix>/full_chain_frac`` (``full_chain_fraction``); empty when no record of ``dataset`` carries a chain."""
    try:
        full = full_chain_fraction(dataset, section["problems"])
    except ValueError as err:
        raise ValueError(f"{prefix}: {err}") from None
    return {} if full is None else {f"{prefix}/{MN.FULL_CHAIN_FRAC}": full[0]}
