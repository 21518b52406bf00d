"""Verifier throughput: answers/s of the math reward with 1 vs 2 worker processes, next to no-pool controls.

Workload: the 500 MATH500 gold solutions (full worked solutions ending in \\boxed{answer}) and the same 500
solutions with the boxed answer perturbed (integers + 1, decimals + 1, ``x=v`` -> ``x=v+1``, anything
else ``(<answer>)+1``): 1000 answers, checked against the ``answer`` field.
Rows: two controls without the pool (fresh processes, each checking a strided share serially, no time
limit: what the machine itself gives 1 and 2 parallel processes), then the pool with 1 and 2 workers
(start-up excluded from the wall time, per-answer time limit on). Median of ``--repeats`` runs, the
configurations interleaved; a side-by-side table, not a test.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_verifier.py [--repeats 3] [--timeout 10]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import re
import statistics
import time

from rich.console import Console
from rich.table import Table

from sparse_rl_megatron.data import load_dataset
from sparse_rl_megatron.rewards import VerifierPool, VerifierPoolConfig, last_boxed, reason_counts


def perturb(answer: str) -> str:
    """A different answer of the same kind: n -> n + 1 for numbers, ``x=v`` -> ``x=perturb(v)``, else
    ``(answer)+1``."""
    text = answer.strip()
    if "=" in text and text.count("=") == 1 and "," not in text:
        lhs, rhs = text.split("=")
        return f"{lhs}={perturb(rhs)}"
    if re.fullmatch(r"-?\d+", text):
        return str(int(text) + 1)
    if re.fullmatch(r"-?\d*\.\d+", text):
        return repr(float(text) + 1)
    return f"({text})+1"


def workload(data_root: str | None) -> list[tuple[str, str, str]]:
    tasks_gold, tasks_wrong = [], []
    for r in load_dataset("math500", root=data_root):
        solution = r.extra["solution"]
        boxed = last_boxed(solution)
        tasks_gold.append((solution, r.answer, "boxed"))
        box_at = solution.rfind("\\boxed")
        head, tail = solution[:box_at], solution[box_at:]
        wrong = head + tail.replace("{" + boxed, "{" + perturb(boxed), 1)
        if last_boxed(wrong) == boxed:
            raise RuntimeError(f"could not perturb the answer of {r.source_id}: {boxed!r}")
        tasks_wrong.append((wrong, r.answer, "boxed"))
    return tasks_gold + tasks_wrong


def run_pool(tasks, workers: int, timeout: float) -> tuple[float, float, list]:
    start = time.perf_counter()
    pool = VerifierPool(VerifierPoolConfig(num_workers=workers, timeout_s=timeout)).start()
    startup = time.perf_counter() - start
    try:
        start = time.perf_counter()
        verdicts = pool.check(tasks)
        return startup, time.perf_counter() - start, verdicts
    finally:
        pool.close()


def _serial_worker(tasks, ready, go, results) -> None:
    from sparse_rl_megatron.rewards import check_answer

    check_answer("\\boxed{1}", "1")  # same warm-up as a pool worker
    ready.put(1)
    go.wait()
    start = time.perf_counter()
    verdicts = [check_answer(*t) for t in tasks]
    results.put((time.perf_counter() - start, [(v.reason == "correct", v.reason) for v in verdicts]))


def run_processes(tasks, processes: int) -> tuple[float, float, list]:
    """Fresh processes checking a strided share of the tasks each, no pool and no time limit: the
    machine's own ceiling for ``processes``-way parallel verification (cold caches, like a new pool)."""
    ctx = multiprocessing.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start = time.perf_counter()
    procs = [ctx.Process(target=_serial_worker, args=(tasks[i::processes], ready, go, results))
             for i in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()
    startup = time.perf_counter() - start
    start = time.perf_counter()
    go.set()
    outs = [results.get() for _ in procs]
    wall = time.perf_counter() - start
    for p in procs:
        p.join()
    verdicts: list = [None] * len(tasks)
    for i, (_, part) in enumerate(outs):  # results arrive in any order: only the counts are used
        verdicts[i::processes] = part
    return startup, wall, [_Counted(*v) for v in verdicts]


class _Counted:
    def __init__(self, correct: bool, reason: str):
        self.correct, self.reason = correct, reason


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (median reported)")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-answer time limit, seconds")
    parser.add_argument("--data-root", default=None)
    args = parser.parse_args()

    tasks = workload(args.data_root)
    console = Console()
    console.print(f"{len(tasks)} answers (500 MATH500 gold solutions + 500 perturbed); {os.cpu_count()} CPUs; "
                  f"load average {os.getloadavg()[0]:.2f}; Python {platform.python_version()}")
    configs = [("1 process, no pool (control)", -1), ("2 processes, no pool (control)", -2),
               ("pool, 1 worker", 1), ("pool, 2 workers", 2)]
    # Configurations interleaved within each repeat, so a load change on the shared machine hits all alike.
    runs: dict[int, list] = {workers: [] for _, workers in configs}
    for _ in range(args.repeats):
        for _, workers in configs:
            runs[workers].append(run_processes(tasks, -workers) if workers < 0
                                 else run_pool(tasks, workers, args.timeout))
    rows, base = [], None
    for label, workers in configs:
        wall = statistics.median(r[1] for r in runs[workers])
        startup = statistics.median(r[0] for r in runs[workers])
        last = runs[workers][-1][2]
        counts = reason_counts(last)
        gold_ok = sum(v.correct for v in last[:500]) if workers > 0 else None
        wrong_ok = sum(v.correct for v in last[500:]) if workers > 0 else None
        rate = len(tasks) / wall
        if workers == 1:
            base = rate
        rows.append((label, startup, wall, rate, gold_ok, wrong_ok, counts))
    table = Table(title="verifier throughput, 1000 MATH500 answers")
    for col in ("configuration", "start s", "wall s", "answers/s", "vs 1 worker", "gold correct", "perturbed correct",
                "timeouts"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for label, startup, wall, rate, gold_ok, wrong_ok, counts in rows:
        table.add_row(label, f"{startup:.2f}", f"{wall:.1f}", f"{rate:.1f}", f"{rate / base:.2f}x",
                      "-" if gold_ok is None else f"{gold_ok}/500", "-" if wrong_ok is None else f"{wrong_ok}/500",
                      str(counts["timeout"]))
    console.print(table)
    # The pool's own cost per answer: a round trip for answers with nothing to verify (no \\boxed{}).
    trivial = [("no final answer here", "1", "boxed")] * 2000
    _, wall, _ = run_pool(trivial, 1, args.timeout)
    console.print(f"pool round trip (1 worker, {len(trivial)} answers without a box): "
                  f"{1e6 * wall / len(trivial):.0f} us per answer; load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
