"""Tasks built in code (problems, reward, model recipe, supervised warm start) by name: ``TASKS``.

A config refers to a task as ``task:<name>``; ``get_task`` resolves it (unknown names list the valid ones).

- ``modchain``: iterate ``x <- (a x + b) mod 10`` for 30 steps from tags in the prompt (the embedded default).
- ``modchain_weak``: the same problems, demonstrations from a weaker teacher (``modchain_teacher.py``): where
  x_27 is odd (and != x_30) they stop after step 27 with probability 0.7, so supervised training cannot reach
  what RL can.
"""
from __future__ import annotations

from sparse_rl_megatron.tasks.base import SPLITS, Task
from sparse_rl_megatron.tasks.modchain import ModChainSpec, ModChainTask
from sparse_rl_megatron.tasks.modchain_teacher import EarlyStopTeacher
from sparse_rl_megatron.utils.registry import Registry

TASK_PREFIX = "task:"

TASKS: Registry[Task] = Registry("task")
TASKS.add("modchain", ModChainTask())
TASKS.add("modchain_weak", ModChainTask(ModChainSpec(teacher=EarlyStopTeacher()), name="modchain_weak"))


def is_task_ref(name: str) -> bool:
    """True for ``task:<name>`` references."""
    return str(name).startswith(TASK_PREFIX)


def get_task(name: str) -> Task:
    """The task registered as ``name`` (with or without the ``task:`` prefix)."""
    name = str(name)
    return TASKS.get(name[len(TASK_PREFIX):] if is_task_ref(name) else name)


__all__ = ["SPLITS", "TASKS", "TASK_PREFIX", "Task", "get_task", "is_task_ref"]
