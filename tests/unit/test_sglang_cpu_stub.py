"""The CPU stand-in for sgl_kernel: importable, and loud if any of its functions is ever called."""
from __future__ import annotations

import importlib
import os
import sys

import pytest

from sglang_ext import cpu_compat


def test_stub_functions_raise_when_called(monkeypatch):
    monkeypatch.syspath_prepend(str(cpu_compat.STUB_DIR))
    sys.modules.pop("sgl_kernel", None)
    try:
        sgl_kernel = importlib.import_module("sgl_kernel")
        assert sgl_kernel.IS_SPARSE_RL_STUB
        fn = sgl_kernel.copy_all_layer_kv_cache_cpu  # an import SGLang's CPU memory pool does
        with pytest.raises(sgl_kernel.SglKernelStubCalled, match="copy_all_layer_kv_cache_cpu was called"):
            fn(1, 2)
        with pytest.raises(AttributeError):
            sgl_kernel.__wrapped__  # dunder lookups (pickle, inspect) must not get a fake function
    finally:
        sys.modules.pop("sgl_kernel", None)


def test_apply_is_cpu_only_and_idempotent(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/some/where")
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.delenv(cpu_compat.TRITON_INTERPRET_ENV, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    assert cpu_compat.apply() is False and "SGLANG_USE_CPU_ENGINE" not in os.environ
    assert cpu_compat.TRITON_INTERPRET_ENV not in os.environ   # on CUDA, Triton compiles its kernels
    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: False)
    assert cpu_compat.apply() is True and cpu_compat.apply() is True
    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1" and os.environ[cpu_compat.TRITON_INTERPRET_ENV] == "1"
    monkeypatch.setenv(cpu_compat.TRITON_INTERPRET_ENV, "0")   # a user's explicit choice stays
    assert cpu_compat.apply() is True and os.environ[cpu_compat.TRITON_INTERPRET_ENV] == "0"
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(cpu_compat.STUB_DIR), "/some/where"]
    assert sys.path.count(str(cpu_compat.STUB_DIR)) == 1
