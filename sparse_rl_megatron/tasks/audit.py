"""Shortcut audit: how well do trivial policies score on a task, compared with chance?

A task measures learning only if its answers cannot be guessed from the prompt. For each split of a task (train
and held-out), the audit scores a family of trivial policies, none of which does the task:

- the task's tempting functions of the prompt (``Task.trivial_answers``; for a chain: each value named in the
  prompt, by letter and by position, the start x0, and stopping after step k for every k < N);
- each constant answer, and the most common training answer.

Chance is 1 / (number of distinct gold answers). A task passes when, on both splits, the best trivial policy is
within ``limit`` of chance: ``max(MARGIN, SE_FACTOR * standard error)``. Measured (docs/embedded-default.md):
``modchain`` and ``modchain_weak`` fail (stopping after step 10 is right on every problem, since every period of
a mod-10 map divides 20; boxing the start x0 is right on 62% of the held-out problems), ``modchain31_weak`` and
``modchain100_weak`` pass.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from sparse_rl_megatron.tasks.base import SPLITS, Task

MARGIN = 0.05
"""How far above chance the best trivial policy may score (5 points, the bar of issue 26)."""
SE_FACTOR = 4.0
"""The limit is at least this many binomial standard errors above chance: the best of ~100 policies on noise
alone stays below it (P(Z > 4) = 3e-5 per policy)."""


@dataclass
class PolicyScore:
    """One trivial policy's accuracy per split."""

    name: str
    accuracy: dict[str, float] = field(default_factory=dict)


@dataclass
class TaskAudit:
    """The audit of one task (``audit_task``)."""

    task: str
    chance: float
    """1 / number of distinct gold answers (over both splits)."""
    records: dict[str, int]
    """Records audited per split."""
    scores: list[PolicyScore]

    def limit(self, split: str) -> float:
        """Highest accuracy a trivial policy may reach on ``split``: chance + max(MARGIN, SE_FACTOR * SE), with
        SE = sqrt(p (1 - p) / n) of a chance-level policy on the split's n records."""
        se = math.sqrt(self.chance * (1 - self.chance) / self.records[split])
        return self.chance + max(MARGIN, SE_FACTOR * se)

    def ranked(self, split: str) -> list[PolicyScore]:
        """The policies, best first on ``split`` (ties by name)."""
        return sorted(self.scores, key=lambda s: (-s.accuracy[split], s.name))

    def best(self, split: str) -> PolicyScore:
        return self.ranked(split)[0]

    @property
    def passed(self) -> bool:
        return all(self.best(split).accuracy[split] <= self.limit(split) for split in self.records)

    def lines(self) -> list[str]:
        """A report: the verdict, then per split the best policy of each group (``group: name``)."""
        answers = round(1 / self.chance)
        out = [f"task:{self.task}: {'PASS' if self.passed else 'FAIL'}  (chance {self.chance:.3f}, {answers} answers)"]
        for split in self.records:
            verdict = "ok" if self.best(split).accuracy[split] <= self.limit(split) else "TOO HIGH"
            out.append(f"  {split} ({self.records[split]} records): best trivial policy "
                       f"{self.best(split).accuracy[split]:.3f}, limit {self.limit(split):.3f}: {verdict}")
            seen: set[str] = set()
            for s in self.ranked(split):
                group = s.name.split(":", 1)[0]
                if group not in seen:
                    seen.add(group)
                    out.append(f"    {s.name:<32} {s.accuracy[split]:.3f}")
        return out


def audit_task(task: Task, seed: int = 0) -> TaskAudit:
    """Score the trivial policies of ``task`` on its train and held-out records (drawn with ``seed``)."""
    splits = {split: task.records(split, seed=seed).records for split in SPLITS}
    empty = [split for split, records in splits.items() if not records]
    if empty:
        raise ValueError(f"task:{task.name}: no {empty[0]} records to audit")
    golds = {split: [r.answer for r in records] for split, records in splits.items()}
    answers = sorted({a for g in golds.values() for a in g})
    counts = {split: Counter(g) for split, g in golds.items()}
    scores: dict[str, PolicyScore] = {}
    for split, records in splits.items():
        right: Counter[str] = Counter()
        names: dict[str, None] = {}
        for r in records:
            for name, answer in task.trivial_answers(r).items():
                names[name] = None
                right[name] += answer is not None and answer == r.answer
        for name in names:
            scores.setdefault(name, PolicyScore(name)).accuracy[split] = right[name] / len(records)
        most_common = counts["train"].most_common(1)[0][0]
        for name, answer in [(f"constant: {a}", a) for a in answers] + [("constant: most common in train", most_common)]:
            scores.setdefault(name, PolicyScore(name)).accuracy[split] = counts[split][answer] / len(records)
    for s in scores.values():  # a policy a split never names scores 0 there
        for split in splits:
            s.accuracy.setdefault(split, 0.0)
    return TaskAudit(task=task.name, chance=1 / len(answers), records={s: len(r) for s, r in splits.items()},
                     scores=list(scores.values()))
