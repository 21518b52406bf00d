"""Tasks built in code (problems, reward, model recipe, supervised warm start) by name: ``TASKS``.

A config refers to a task as ``task:<name>``; ``get_task`` resolves it (unknown names list the valid ones).

- ``modchain``: iterate ``x <- (a x + b) mod 10`` for 30 steps from tags in the prompt (the embedded default).
"""
from __future__ import annotations

from sparse_rl_megatron.tasks.base import SPLITS, Task
from sparse_rl_megatron.tasks.modchain import ModChainTask
from sparse_rl_megatron.utils.registry import Registry

TASK_PREFIX = "task:"

TASKS: Registry[Task] = Registry("task")
TASKS.add("modchain", ModChainTask())


def is_task_ref(name: str) -> bool:
    """True for ``task:<name>`` references."""
    return str(name).startswith(TASK_PREFIX)


def get_task(name: str) -> Task:
    """The task registered as ``name`` (with or without the ``task:`` prefix)."""
    name = str(name)
    return TASKS.get(name[len(TASK_PREFIX):] if is_task_ref(name) else name)


__all__ = ["SPLITS", "TASKS", "TASK_PREFIX", "Task", "get_task", "is_task_ref"]
