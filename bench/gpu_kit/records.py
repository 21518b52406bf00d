"""Results written as they are measured, peak memory, and the part's deadline.

Every measurement is one JSON line ``{"part", "item", "ok", "seconds", ...metrics}`` appended to
``records.jsonl`` and flushed at once, so a part killed at its time box keeps every item it finished. An item
that raises is recorded with ``ok: false`` and the error, and the part goes on with its next item.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch

RECORDS_FILE = "records.jsonl"


class Deadline(Exception):
    """Raised inside a measurement when its part's time is up (the measurement keeps what it had)."""


class Recorder:
    """Appends this part's records to ``out_dir/records.jsonl``; ``deadline`` is a ``time.monotonic()`` value."""

    def __init__(self, out_dir: str | os.PathLike, part: str, deadline: float):
        self.path = Path(out_dir) / RECORDS_FILE
        self.part = part
        self.deadline = deadline

    def left(self) -> float:
        """Seconds left before this part's box closes."""
        return self.deadline - time.monotonic()

    def write(self, item: str, ok: bool = True, **metrics: Any) -> dict:
        rec = {"part": self.part, "item": item, "ok": ok, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=_jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"[{self.part}] {item}: " + json.dumps(metrics, default=_jsonable)[:400], flush=True)
        return rec

    @contextlib.contextmanager
    def item(self, name: str) -> Iterator[dict]:
        """``with rec.item("x") as m: m["metric"] = ...``: one record with the metrics set inside the block,
        its wall seconds, and ``ok: false`` plus the error if the block raised (a ``Deadline`` keeps
        ``partial: true``). Exceptions do not escape: the part goes on with its next item."""
        metrics: dict = {}
        start = time.perf_counter()
        try:
            yield metrics
        except Deadline as exc:
            self.write(name, ok=False, partial=True, error=f"time box reached: {exc}",
                       seconds=round(time.perf_counter() - start, 3), **metrics)
        except Exception as exc:  # noqa: BLE001 -- one failed measurement must not cost the others
            tail = "".join(traceback.format_exception(exc))[-2000:]
            self.write(name, ok=False, error=f"{type(exc).__name__}: {exc}"[:500], traceback=tail,
                       seconds=round(time.perf_counter() - start, 3), **metrics)
        else:
            self.write(name, ok=True, seconds=round(time.perf_counter() - start, 3), **metrics)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_records(out_dir: str | os.PathLike) -> list[dict]:
    """Every record written so far (a half-written last line, from a kill mid-write, is skipped)."""
    path = Path(out_dir) / RECORDS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PeakMeter:
    """Peak memory of a block above the memory in use when it starts.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (bytes held by tensors).
    CPU: the peak resident set (VmHWM, reset through ``/proc/self/clear_refs``) over the RSS at the start;
    coarser (allocator caching and page granularity), good to about a megabyte.
    """

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.base = 0
        self.peak = 0

    def __enter__(self) -> "PeakMeter":
        sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        sync()
        self.peak = torch.cuda.max_memory_allocated() if self.cuda else _status_kib("VmHWM") * 1024

    @property
    def rise(self) -> int:
        """Bytes above the start: the block's peak extra memory."""
        return max(0, self.peak - self.base)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def gib(n: float) -> float:
    return round(n / 2**30, 3)
