"""Worker side of the megatron test harness: run named checks in order and record each outcome.

The first failing check writes its traceback and ends the process with status 1, which makes torchrun stop
the other ranks (they could otherwise wait forever in a collective the failed rank never joins).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable


def run_checks(checks: list[tuple[str, Callable[[], None]]], result_dir: str) -> None:
    """Run ``checks`` in order on this rank and record each outcome; exit 1 at the first failure."""
    rank = int(os.environ.get("RANK", "0"))
    out = Path(result_dir) / f"rank{rank}.json"
    records: list[dict] = []
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            fn()
            records.append({"check": name, "status": "pass", "seconds": round(time.perf_counter() - t0, 2)})
            out.write_text(json.dumps(records))
        except BaseException:  # noqa: BLE001 - report everything, including SystemExit from argparse
            records.append({"check": name, "status": "fail", "traceback": traceback.format_exc()})
            out.write_text(json.dumps(records))
            sys.stderr.write(f"[rank {rank}] check {name} FAILED\n{records[-1]['traceback']}\n")
            sys.stderr.flush()
            os._exit(1)
    out.write_text(json.dumps(records))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown problems must not mask the recorded results
        pass
