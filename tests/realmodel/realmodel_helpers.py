"""Helpers of the real-model tier, importable by its test files (``from realmodel_helpers import ...``; a name of
its own, so any selection of test folders collects: every tier has a ``conftest``)."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def env() -> dict:
    """The environment of a process a test starts: one thread, no GPU, quiet, the checkout importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "TORCH_CPP_LOG_LEVEL": "ERROR"}
