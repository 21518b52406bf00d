"""``sparse-rl audit [TASK ...]``: the shortcut audit of built-in tasks (``tasks/audit.py``).

Prints, per task, PASS or FAIL and the best trivial policy of each group on its train and held-out records; exits 1 when a
task fails (a trivial policy scores more than the limit above chance).
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tasks", nargs="*", metavar="TASK",
                        help="task names (task:modchain or modchain); default: every built-in task")
    parser.add_argument("--seed", type=int, default=0, help="seed of the records (distractors, tag order)")


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.tasks import TASKS, get_task
    from sparse_rl_megatron.tasks.audit import audit_task
    from sparse_rl_megatron.utils.errors import UsageError
    from sparse_rl_megatron.utils.registry import UnknownNameError

    try:
        tasks = [get_task(name) for name in args.tasks] or [TASKS.get(name) for name in TASKS.names()]
    except UnknownNameError as err:
        raise UsageError(str(err)) from None
    failed = 0
    for task in tasks:
        result = audit_task(task, seed=args.seed)
        print("\n".join(result.lines()), flush=True)
        failed += not result.passed
    return 1 if failed else 0
