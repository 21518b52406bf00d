"""Per-step metrics to JSONL (the record of a run) and TensorBoard (to watch it live).

Each ``write(step, metrics)`` appends one JSON line ``{"step": ..., "time": ..., <key>: <float>}`` and the same
scalars to TensorBoard. Non-finite values are kept in the JSONL as ``null`` (JSON has no NaN) so a plot shows the
gap instead of a crash. ``plots.py`` turns the JSONL into PNG figures.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Mapping

METRICS_FILE = "metrics.jsonl"


def _as_float(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class MetricsWriter:
    """Appends metrics of a run under ``run_dir`` (``metrics.jsonl`` and ``tensorboard/``).

    ``resume_step``: the run continues after that step (resumed from a checkpoint): records of later steps,
    written by the interrupted run after its checkpoint, are dropped from both logs so no step appears twice.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None and self.path.is_file():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_name(METRICS_FILE + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.path)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1  # TensorBoard drops events from this step on
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge)

    def write(self, step: int, metrics: Mapping[str, object]) -> dict:
        record = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            record[key] = _as_float(value)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "time") and value is not None:
                    self._tb.add_scalar(key, value, int(step))
            self._tb.flush()
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a ``metrics.jsonl`` (a torn last line from a crash is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
