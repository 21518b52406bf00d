"""Benchmark evaluation: model x benchmarks x inference mode (dense or compressed KV) x sampling.

The names below are imported on first use, so that ``sparse-rl eval --help`` (which imports ``eval.cli``)
does not pay for torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "BenchmarkSettings": "sparse_rl_megatron.eval.config",
    "EvalConfig": "sparse_rl_megatron.eval.config",
    "PAPER_PRESET": "sparse_rl_megatron.eval.config",
    "avg_at_k": "sparse_rl_megatron.eval.metrics",
    "mean_pass_at_k": "sparse_rl_megatron.eval.metrics",
    "pass_at_k": "sparse_rl_megatron.eval.metrics",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
