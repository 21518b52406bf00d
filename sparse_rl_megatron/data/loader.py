"""Read a JSONL or Parquet file into ``MathRecord``s, skipping (and counting) the rows that cannot be used.

A malformed row (bad JSON, not an object, a missing or empty field) is skipped; each one is logged with its
file and line, and all of them are kept in ``Dataset.skipped``. A file with no usable row is an error.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from sparse_rl_megatron.data.formats import MalformedRow, RowMapper
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.utils.errors import UserError

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# Skipped rows logged one by one; past this, only the summary line (a broken file would flood the log).
_MAX_LOGGED_SKIPS = 20


class DataError(UserError, ValueError):
    """A data set that cannot be used as given (unknown name, unknown file type, no usable row)."""


class EmptyDatasetError(DataError):
    """A data file in which no row could be used."""


class DataFileNotFoundError(UserError, FileNotFoundError):
    """A data file, or the file of a named set under the data root, that does not exist."""


@dataclass
class SkippedRow:
    """A row the loader could not use."""

    path: str
    line: int
    """1-based line (JSONL) or row number (Parquet)."""
    reason: str


@dataclass
class Dataset(Sequence[MathRecord]):
    """The usable records of one file, and what was skipped."""

    name: str
    path: str
    records: list[MathRecord]
    skipped: list[SkippedRow] = field(default_factory=list)
    filtered: int = 0
    """Well-formed rows left out on purpose (e.g. MATH levels 1-2 of ``math_train_l3to5``)."""

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):  # type: ignore[override]
        return self.records[i]

    def __iter__(self) -> Iterator[MathRecord]:
        return iter(self.records)


def iter_rows(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """``(line, row, error)`` for every non-blank row of a JSONL (or Parquet) file; ``error`` if unreadable."""
    path = Path(path)
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield line_no, None, f"invalid JSON ({exc.msg} at column {exc.colno})"
                continue
            if not isinstance(row, dict):
                yield line_no, None, f"a JSON {type(row).__name__}, expected an object"
                continue
            yield line_no, row, None


def _iter_parquet(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed; install it (pip install pyarrow) "
            "or convert the file to JSONL"
        ) from None
    table = pq.read_table(path)
    for i, row in enumerate(table.to_pylist(), start=1):
        yield i, row, None


def load_file(
    path: str | os.PathLike,
    mapper: RowMapper,
    dataset: str,
    *,
    keep: Callable[[dict], bool] | None = None,
    limit: int | None = None,
) -> Dataset:
    """Map every row of ``path`` with ``mapper``; skip and count malformed rows.

    ``keep(row)`` filters well-formed rows (counted in ``Dataset.filtered``); ``limit`` keeps the first N
    usable records. Raises ``FileNotFoundError`` for a missing file and ``EmptyDatasetError`` when no row
    is usable.
    """
    path = Path(path)
    if not path.is_file():
        raise DataFileNotFoundError(f"data file not found: {path}")
    if path.suffix not in FILE_SUFFIXES:
        raise DataError(f"data file {path}: unknown suffix '{path.suffix}'; valid: {', '.join(FILE_SUFFIXES)}")
    records: list[MathRecord] = []
    skipped: list[SkippedRow] = []
    filtered = 0
    for line, row, error in iter_rows(path):
        if error is None:
            try:
                if keep is not None and not keep(row):
                    filtered += 1
                    continue
                records.append(MathRecord(dataset=dataset, **mapper(row, line)))
            except (MalformedRow, KeyError, TypeError, ValueError) as exc:
                error = str(exc)
        if error is not None:
            skipped.append(SkippedRow(str(path), line, error))
            if len(skipped) <= _MAX_LOGGED_SKIPS:
                log.warning("%s:%d: skipped malformed row: %s", path, line, error)
            continue
        if limit is not None and len(records) >= limit:
            break
    if skipped:
        log.warning("%s: skipped %d malformed row(s), kept %d", path, len(skipped), len(records))
    if not records:
        raise EmptyDatasetError(
            f"data file {path} has no usable rows ({len(skipped)} malformed, {filtered} filtered out)"
            + (f"; first problem: line {skipped[0].line}: {skipped[0].reason}" if skipped else "")
        )
    return Dataset(name=dataset, path=str(path), records=records, skipped=skipped, filtered=filtered)
