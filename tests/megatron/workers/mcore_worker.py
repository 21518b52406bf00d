"""Worker side of the megatron test harness: run named checks in order and record each outcome.

One failed check is one failed test; the checks after it still run and report:
- a comparison written with :func:`expect` fails its check without stopping it, so the check runs to its end on
  every rank (no rank is left waiting in a collective that a failed rank skipped) and the next check starts;
- in a single process any exception fails only its check (there is no other rank to leave waiting);
- under torchrun an exception (a crash, an ``assert`` on a structure) still ends the rank with status 1, which
  makes torchrun stop the other ranks: they could otherwise wait forever in a collective the failed rank never
  joins. Its later checks show as "did not run" with the launch's output.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

_failed: list[str] = []


def expect(ok: bool, message: str) -> None:
    """A comparison of the running check: when ``ok`` is false the check is recorded failed with ``message``
    once it has run to its end (the rest of it runs, collectives included)."""
    if not ok:
        _failed.append(message)


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
