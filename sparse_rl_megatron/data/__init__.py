"""Math data sets (named sets under a data root, user JSONL/Parquet files) and prompt templates."""
from sparse_rl_megatron.data.formats import FORMATS, MalformedRow
from sparse_rl_megatron.data.loader import (
    DataError, DataFileNotFoundError, Dataset, EmptyDatasetError, SkippedRow, load_file,
)
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.data.sets import BENCHMARKS, DATASETS, check_dataset, data_root, dataset_path, load_dataset
from sparse_rl_megatron.data.templates import COT_INSTRUCTION, TEMPLATES, render_prompt

__all__ = [
    "BENCHMARKS", "COT_INSTRUCTION", "DATASETS", "DataError", "DataFileNotFoundError", "Dataset",
    "EmptyDatasetError", "FORMATS", "MalformedRow", "MathRecord", "SkippedRow", "TEMPLATES", "check_dataset",
    "data_root", "dataset_path", "load_dataset", "load_file", "render_prompt",
]
