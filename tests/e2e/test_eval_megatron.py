"""The Megatron-checkpoint seam of `sparse-rl eval`: detection, the clear error without the converter,
and (where the converter is present) a converted checkpoint evaluating exactly like its HF source."""
import json
import os
import subprocess
import sys

import pytest

from sparse_rl_megatron.eval.model_source import is_megatron_checkpoint, resolve_hf_model
from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint


def test_hf_dir_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_hf_model(tmp_path) == tmp_path


def test_megatron_checkpoint_without_converter_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "sparse_rl_checkpoint.json").write_text("{}")
    assert is_megatron_checkpoint(tmp_path)
    monkeypatch.setitem(sys.modules, "sparse_rl_megatron.learner.convert", None)  # import now fails
    with pytest.raises(RuntimeError, match="Megatron checkpoint.*export_to_hf"):
        resolve_hf_model(tmp_path)


def test_neither_hf_nor_megatron_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="neither an HF model directory"):
        resolve_hf_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_hf_model(tmp_path / "missing")


# One subprocess converts and evaluates (megatron-core's import and torch.distributed state stay out of the
# test process); the HF reference runs in-process.
_CONVERT_AND_EVAL = """
import sys
from sparse_rl_megatron.cli import main
hf, mcore, out, *common = sys.argv[1:]
assert main(["convert", "hf-to-megatron", "--input", hf, "--output", mcore]) == 0
assert main(["eval", "--model", mcore, "--output", out, *common]) == 0
"""


@pytest.mark.timeout(300)
def test_megatron_checkpoint_evaluates_like_its_hf_source(tmp_path, shared_data):
    from sparse_rl_megatron.cli import main

    pytest.importorskip("sparse_rl_megatron.learner.convert")
    hf = save_tiny_hf_checkpoint(tmp_path / "hf", "qwen2", seed=1)
    common = ["--data-root", str(shared_data), "--benchmarks", "gsm8k", "--limit", "2", "--n", "1",
              "--max-new-tokens", "12", "--no-progress", "--verifier-workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _CONVERT_AND_EVAL, str(hf), str(tmp_path / "mcore"),
                           str(tmp_path / "mcore.json"), *common], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert is_megatron_checkpoint(tmp_path / "mcore")
    assert main(["eval", "--model", str(hf), "--output", str(tmp_path / "hf.json"), *common]) == 0
    responses = [
        [s["response"] for p in json.loads((tmp_path / f"{name}.json").read_text())["benchmarks"]["gsm8k"]["problems"]
         for s in p["samples"]]
        for name in ("hf", "mcore")
    ]
    assert responses[0] == responses[1] and all(responses[0])  # same weights, same seed: same samples
