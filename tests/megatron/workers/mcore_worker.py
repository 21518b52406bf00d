"""Worker side of the megatron test harness: run the checks of a launch in order and record each outcome.

A check is a function in a test file, decorated with :func:`mcore_check` (the launches that run it, its
parameter sets); the pytest test next to it passes the function object to ``LaunchResult.check``. A launch's
worker script builds the shared context (references, work folder, learners) and calls :func:`run_launch`,
which imports the test modules of the launch and runs their checks, so a failure's traceback points into the
test file.

One failed check is one failed test; the checks after it still run and report:
- a comparison written with :func:`expect` fails its check without stopping it, so the check runs to its end on
  every rank (no rank is left waiting in a collective that a failed rank skipped) and the next check starts;
- in a single process any exception fails only its check (there is no other rank to leave waiting);
- under torchrun an exception (a crash, an ``assert`` on a structure) still ends the rank with status 1, which
  makes torchrun stop the other ranks: they could otherwise wait forever in a collective the failed rank never
  joins. Its later checks show as "did not run" with the launch's output.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

_failed: list[str] = []


def expect(ok: bool, message: str) -> None:
    """A comparison of the running check: when ``ok`` is false the check is recorded failed with ``message``
    once it has run to its end (the rest of it runs, collectives included)."""
    if not ok:
        _failed.append(message)


@dataclass
class CheckSpec:
    """What :func:`mcore_check` records on a check function: its parameter sets per launch."""

    runs: dict[str, tuple[dict, ...]]
    after: tuple[Callable, ...]


def mcore_check(launch: str | tuple[str, ...], params: list[dict] | None = None,
                after: tuple[Callable, ...] = ()) -> Callable:
    """Mark ``fn(ctx, **p)`` as a check run by the worker of ``launch`` (one launch or several), once per ``p`` in
    ``params`` (once without arguments when None), after every run of the checks in ``after``. Stacked, one
    decorator per launch gives each launch its own parameter sets."""
    launches = (launch,) if isinstance(launch, str) else tuple(launch)

    def mark(fn: Callable) -> Callable:
        spec = getattr(fn, "mcore_check", None) or CheckSpec({}, ())
        spec.runs.update({name: tuple(dict(p) for p in (params or [{}])) for name in launches})
        spec.after += tuple(after)
        fn.mcore_check = spec
        return fn

    return mark


def check_key(fn: Callable, params: dict) -> str:
    """The record name of one run of a check: its module, its name and its parameters (never written by hand)."""
    spec = getattr(fn, "mcore_check", None)
    if spec is None:
        raise TypeError(f"{fn!r} is not a check (decorate it with @mcore_check)")
    known = [p for runs in spec.runs.values() for p in runs]
    if dict(params) not in known:
        raise ValueError(f"{fn.__qualname__} has no parameter set {params}; it runs with {known}")
    args = ",".join(f"{k}={v!r}" for k, v in sorted(params.items()))
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}[{args}]"


def launch_checks(launch: str, modules: list[str], group_by: str | None = None) -> list[tuple[str, Callable, dict]]:
    """The checks of ``launch`` in ``modules`` (imported in this order): module order, then definition order, then
    parameter order; with ``group_by``, the runs whose parameter ``group_by`` has one value run together, where
    the first of them would (a layout's learners are built, checked and trained before the next layout's);
    last, each check moves after the checks it names in ``after``."""
    import inspect

    runs = []  # (fn, params)
    for name in modules:
        mod = importlib.import_module(name)
        fns = [f for f in vars(mod).values() if inspect.isfunction(f) and f.__module__ == mod.__name__
               and launch in getattr(f, "mcore_check", CheckSpec({}, ())).runs]
        for fn in sorted(fns, key=lambda f: f.__code__.co_firstlineno):
            runs += [(fn, p) for p in fn.mcore_check.runs[launch]]
    if group_by:
        grouped, seen = [], []
        for fn, p in runs:
            if group_by not in p:
                grouped.append((fn, p))
            elif p[group_by] not in seen:
                seen.append(p[group_by])
                grouped += [(f, q) for f, q in runs if q.get(group_by, object()) == p[group_by]]
        runs = grouped
    ordered: list = []
    while runs:
        waiting = {fn for fn, _ in runs}
        i = next((i for i, (fn, _) in enumerate(runs) if not waiting & set(fn.mcore_check.after)), None)
        if i is None:
            raise RuntimeError(f"checks of {launch!r} wait on each other: {sorted(f.__qualname__ for f in waiting)}")
        ordered.append(runs.pop(i))
    return [(check_key(fn, p), fn, p) for fn, p in ordered]


def run_launch(launch: str, modules: list[str], ctx: object, result_dir: str, group_by: str | None = None) -> None:
    """Run the checks of ``launch`` found in the test ``modules`` (tests/megatron), each as ``fn(ctx, **params)``,
    in the order of :func:`launch_checks`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/megatron: the test modules
    run_checks([(key, lambda fn=fn, p=p: fn(ctx, **p)) for key, fn, p in launch_checks(launch, modules, group_by)],
               result_dir)


def run_checks(checks: list[tuple[str, Callable[[], None]]], result_dir: str) -> None:
    """Run ``checks`` in order on this rank and record each outcome (see the module docstring)."""
    rank = int(os.environ.get("RANK", "0"))
    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
    out = Path(result_dir) / f"rank{rank}.json"
    records: list[dict] = []
    for name, fn in checks:
        _failed.clear()
        t0 = time.perf_counter()
        try:
            fn()
        except BaseException:  # noqa: BLE001 - report everything, including SystemExit from argparse
            records.append({"check": name, "status": "fail",
                            "traceback": "".join(f"expected: {m}\n" for m in _failed) + traceback.format_exc()})
            out.write_text(json.dumps(records))
            sys.stderr.write(f"[rank {rank}] check {name} FAILED\n{records[-1]['traceback']}\n")
            sys.stderr.flush()
            if alone:
                continue
            os._exit(1)
        seconds = round(time.perf_counter() - t0, 2)
        if _failed:
            records.append({"check": name, "status": "fail", "seconds": seconds,
                            "traceback": "".join(f"expected: {m}\n" for m in _failed)})
            sys.stderr.write(f"[rank {rank}] check {name} FAILED\n{records[-1]['traceback']}")
        else:
            records.append({"check": name, "status": "pass", "seconds": seconds})
        out.write_text(json.dumps(records))
    out.write_text(json.dumps(records))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown problems must not mask the recorded results
        pass
    if any(r["status"] == "fail" for r in records):
        sys.exit(1)
