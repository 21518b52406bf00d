"""Named data sets, resolved under a data root; and ``load_dataset`` for a name or a user file.

The data root defaults to ``../shared/data`` next to the project root, or ``$SPARSE_RL_DATA``, or what the
caller passes. The project never commits copies of these files and never downloads any at run time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sparse_rl_megatron.data.formats import FORMATS, user_format
from sparse_rl_megatron.data.loader import FILE_SUFFIXES, DataError, DataFileNotFoundError, Dataset, load_file
from sparse_rl_megatron.utils.registry import Registry

DATA_ROOT_ENV = "SPARSE_RL_DATA"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named set lives under the data root, and how its rows map to records."""

    path: str
    """File path relative to the data root."""
    format: str
    """Name of the row mapping in ``formats.FORMATS``."""
    keep: Callable[[dict], bool] | None = None
    """Row filter (well-formed rows it rejects are counted as filtered, not malformed)."""
    description: str = ""


DATASETS: Registry[DatasetSpec] = Registry("data set")


def _math_level_at_least(level: int) -> Callable[[dict], bool]:
    def keep(row: dict) -> bool:
        digits = str(row.get("level", "")).replace("Level", "").strip()
        return digits.isdigit() and int(digits) >= level  # "Level ?" (2 rows) is left out

    return keep


DATASETS.add("gsm8k", DatasetSpec("eval/gsm8k/test.jsonl", "gsm8k", description="GSM8K test (1319)"))
DATASETS.add("math500", DatasetSpec("eval/math500/test.jsonl", "math500", description="MATH500 (500)"))
DATASETS.add("minerva_math", DatasetSpec("eval/minerva_math/test.jsonl", "minerva_math",
                                         description="Minerva Math / MIT OCW (272)"))
DATASETS.add("gaokao2023en", DatasetSpec("eval/gaokao2023en/test.jsonl", "gaokao2023en",
                                         description="Gaokao 2023 English (385; 2 rows have no answer)"))
DATASETS.add("olympiadbench", DatasetSpec("eval/olympiadbench/test.jsonl", "olympiadbench",
                                          description="OlympiadBench math, English, text-only (675)"))
DATASETS.add("aime24", DatasetSpec("eval/aime24/test.jsonl", "aime", description="AIME 2024 (30)"))
DATASETS.add("amc23", DatasetSpec("eval/amc23/test.jsonl", "amc", description="AMC 2023 (40)"))
DATASETS.add("math_train", DatasetSpec("train/math/train.jsonl", "math", description="MATH train, all levels"))
DATASETS.add("math_train_l3to5", DatasetSpec("train/math/train.jsonl", "math", keep=_math_level_at_least(3),
                                             description="MATH train levels 3-5 (5586): the reference runs"))
DATASETS.add("gsm8k_train", DatasetSpec("train/gsm8k/train.jsonl", "gsm8k", description="GSM8K train (7473)"))

BENCHMARKS = ("gsm8k", "math500", "minerva_math", "gaokao2023en", "olympiadbench", "aime24", "amc23")
"""The seven evaluation sets of the Sparse-RL paper."""


def data_root(override: str | os.PathLike | None = None) -> Path:
    """The data root: ``override``, else ``$SPARSE_RL_DATA``, else ``<project>/../shared/data``."""
    if override:
        return Path(override)
    if os.environ.get(DATA_ROOT_ENV):
        return Path(os.environ[DATA_ROOT_ENV])
    return PROJECT_ROOT.parent / "shared" / "data"


def dataset_path(name: str, root: str | os.PathLike | None = None, root_option: str = "data_root") -> Path:
    """Absolute path of the named set's file; a clear error if the data root does not hold it.

    ``root_option``: how the calling command sets the data root (``--data-root``, ``data.data_root``), for the
    message.
    """
    spec = DATASETS.get(name)
    path = data_root(root) / spec.path
    if not path.is_file():
        raise DataFileNotFoundError(
            f"data set '{name}' expects {path}, which does not exist; point the data root at the shared "
            f"data folder with {root_option} or ${DATA_ROOT_ENV} (it is never downloaded)"
        )
    return path


def check_dataset(name_or_path: str | os.PathLike, root: str | os.PathLike | None = None, *,
                  option: str | None = None, root_option: str = "data_root") -> Path:
    """The file behind a named set or a user data file, checked before anything loads.

    ``option`` / ``root_option``: how the calling command names the data set (the message starts with it) and
    the data root. Raises ``DataError`` (neither a named set nor a data file) or ``DataFileNotFoundError``.
    """
    name = str(name_or_path)
    if name in DATASETS:
        return dataset_path(name, root, root_option)
    path = Path(name)
    where = f"{option}: " if option else ""
    if path.suffix not in FILE_SUFFIXES and not path.exists():
        raise DataError(
            f"{where}'{name}' is neither a named data set (valid names: {', '.join(DATASETS.names())}) nor a "
            f"data file ({', '.join(FILE_SUFFIXES)})"
        )
    if not path.is_file():
        raise DataFileNotFoundError(f"{where}data file not found: {path}")
    return path


def load_dataset(
    name_or_path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    format: str | None = None,
    input_key: str = "prompt",
    label_key: str = "answer",
    id_key: str | None = None,
    answer_style: str = "boxed",
    label_is_solution: bool = False,
    limit: int | None = None,
    option: str | None = None,
    root_option: str = "data_root",
) -> Dataset:
    """Load a named set (see ``DATASETS``) or a user JSONL/Parquet file.

    A user file maps with ``format`` (one of ``FORMATS``, for a copy of a published file) or else with
    ``input_key`` (the prompt field) and ``label_key`` (the gold answer; a worked solution if
    ``label_is_solution``). ``limit`` keeps the first N usable records. ``option`` / ``root_option``: see
    ``check_dataset``.
    """
    name = str(name_or_path)
    path = check_dataset(name, root, option=option, root_option=root_option)
    if name in DATASETS:
        spec = DATASETS.get(name)
        return load_file(path, FORMATS.get(spec.format), name, keep=spec.keep, limit=limit)
    if format is not None:
        mapper = FORMATS.get(format)
    else:
        mapper = user_format(input_key, label_key, id_key=id_key, answer_style=answer_style,
                             label_is_solution=label_is_solution)
    return load_file(path, mapper, path.stem if path.stem not in ("test", "train") else
                     f"{path.parent.name}_{path.stem}", limit=limit)
