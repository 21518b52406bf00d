"""The results file of ``sparse-rl eval``: one JSON document.

Layout (``FORMAT_VERSION`` 1)::

    {"format_version": 1,
     "meta": {"model", "engine", "mode", "compression": {...}, "template", "temperature", "top_p", "seed", ...},
     "benchmarks": {
        "<name>": {"dataset", "path", "n", "max_new_tokens", "skipped_rows", "seconds": {"generate", "verify"},
                   "metrics": {"avg@<n>", "pass@<k>"..., "problems", "samples", "reasons": {...},
                               "mean_response_tokens", "truncated_fraction", "mean_compression_events",
                               "max_peak_kv_tokens", and for tasks that flag them
                               "shortcut_free_accuracy", "shortcut_free_problems", and for chain
                               tasks "full_chain_frac"},
                   "problems": [{"source_id", "problem", "gold", "answer_style", "correct",
                                 "samples": [{"index", "response", "answer", "reward", "reason", "detail",
                                              "finish_reason", "response_tokens", "compression_events",
                                              "peak_kv_tokens"}]}]}}}
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from sparse_rl_megatron.utils.errors import UserError
from sparse_rl_megatron.utils.file_checks import read_json_file

FORMAT_VERSION = 1


def default_results_name(model: str | os.PathLike, mode: str) -> str:
    """``eval-<parent>_<model dir>-<mode>.json``: the parent folder tells apart the many model directories named
    ``checkpoint`` or ``hf`` (``runs/a/step_100/checkpoint`` -> ``eval-step_100_checkpoint-rkv-B512-W128.json``)."""
    parts = Path(os.path.abspath(model)).parts[-2:]
    model_id = re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(p for p in parts if p != os.sep))
    return f"eval-{model_id}-{mode}.json"


def write_results(results: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``results`` as JSON (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, ensure_ascii=False), encoding="utf-8")
    tmp.replace(path)  # never leave a half-written results file behind
    return path


def read_results(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a results file; a ``UserError`` names the file and what is wrong with it."""
    path = Path(path)
    data = read_json_file(path, "results file")
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: expected format_version {FORMAT_VERSION} of a `sparse-rl eval` results file, "
                        f"got {data.get('format_version') if isinstance(data, dict) else type(data).__name__}")
    for key in ("meta", "benchmarks"):
        if not isinstance(data.get(key), dict):
            raise UserError(f"{path}: missing the '{key}' section of a results file")
    for name, bench in data["benchmarks"].items():
        for key in ("metrics", "problems", "n"):
            if not isinstance(bench, dict) or key not in bench:
                raise UserError(f"{path}: benchmark '{name}' has no '{key}'")
    return data
