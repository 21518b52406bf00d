"""`sparse-rl convert` refuses a bad layout, an existing output and overlapping paths before torch loads
(one line, exit 2, nothing written), replaces only with --overwrite (and only an output of the same kind, as a
whole), and runs without the CPU-expected megatron-core warnings."""
import argparse
import json
import os
import shutil
import subprocess

import torch

from mcore_harness import PYTHON, ROOT
from sparse_rl_megatron.cli import main


def _snapshot(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def convert_error(capsys, *argv) -> str:
    try:
        rc = main(["convert", *map(str, argv)])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "loading torch" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("sparse-rl convert: error: "), err
    return line.removeprefix("sparse-rl convert: error: ")


def test_layout_is_checked_against_the_model_then_the_process_count(mcore_refs, tmp_path, capsys):
    hf = mcore_refs.parent / "qwen2_tied"  # 14 heads, 2 KV groups, FFN 128, 2 layers
    out = tmp_path / "out"
    msg = convert_error(capsys, "hf-to-megatron", "--input", hf, "--output", out, "--tensor-parallel-size", "3")
    assert msg.startswith(f"--input {hf}: --tensor-parallel-size 3 does not divide num_attention_heads=14, "
                          "num_query_groups (num_key_value_heads)=2")
    assert msg.endswith("valid --tensor-parallel-size values divide all of them: 1, 2")
    msg = convert_error(capsys, "hf-to-megatron", "--input", hf, "--output", out, "--tensor-parallel-size", "2")
    assert msg == ("--tensor-parallel-size 2 x --pipeline-parallel-size 1 needs 2 processes (one per shard) and this "
                   "is a single process; launch it with `torchrun --nproc-per-node 2 -m sparse_rl_megatron.cli convert "
                   "hf-to-megatron ...`, or drop the layout flags: a checkpoint saved at TP = PP = 1 loads at any layout")
    assert "--pipeline-parallel-size 4 does not divide num_layers=2" in convert_error(
        capsys, "hf-to-megatron", "--input", hf, "--output", out, "--pipeline-parallel-size", "4")
    assert not out.exists()


def test_existing_outputs_and_overlaps_are_refused_untouched(mcore_refs, tp1_checkpoint, tmp_path, capsys):
    hf = mcore_refs.parent / "qwen2_tied"
    before = _snapshot(tp1_checkpoint)
    assert convert_error(capsys, "hf-to-megatron", "--input", hf, "--output", tp1_checkpoint) == (
        f"--output: {tp1_checkpoint} already exists and is not empty; choose another path or pass --overwrite")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    assert convert_error(capsys, "hf-to-megatron", "--input", hf, "--output", other, "--overwrite") == (
        f"--output: {other} is not a sparse-rl Megatron checkpoint (no sparse_rl_checkpoint.json); --overwrite only "
        "replaces a sparse-rl Megatron checkpoint, never another file or directory")
    assert convert_error(capsys, "megatron-to-hf", "--input", tp1_checkpoint, "--output", tp1_checkpoint,
                         "--overwrite") == (
        f"--output {tp1_checkpoint} and --input {tp1_checkpoint} overlap; write the conversion elsewhere")
    assert "overlap" in convert_error(capsys, "megatron-to-hf", "--input", tp1_checkpoint, "--output",
                                      tp1_checkpoint / "hf")
    assert convert_error(capsys, "megatron-to-hf", "--input", tp1_checkpoint, "--output", other).startswith(
        f"--output: {other} already exists and is not empty")
    assert "is not an HF model directory (no config.json)" in convert_error(
        capsys, "megatron-to-hf", "--input", tp1_checkpoint, "--output", other, "--overwrite")
    assert convert_error(capsys, "megatron-to-hf", "--input", hf, "--output", tmp_path / "x") == (
        f"--input: {hf / 'sparse_rl_checkpoint.json'} not found: {hf} is not a sparse-rl Megatron checkpoint (for an "
        "HF directory, use hf-to-megatron)")
    assert _snapshot(tp1_checkpoint) == before and (other / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


def test_megatron_to_hf_overwrite_replaces_the_whole_export(tp1_checkpoint, tmp_path):
    # model-free and torch-only: in this process
    out = tmp_path / "hf"
    assert main(["convert", "megatron-to-hf", "--input", str(tp1_checkpoint), "--output", str(out)]) == 0
    first = _snapshot(out)
    (out / "model-00001-of-00002.safetensors").write_bytes(b"a stale shard of another export")
    assert main(["convert", "megatron-to-hf", "--input", str(tp1_checkpoint), "--output", str(out), "--overwrite"]) == 0
    assert _snapshot(out) == first  # the stale shard went with the old export
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging or old directory left behind


def test_hf_to_megatron_overwrite_replaces_a_checkpoint_without_cpu_warnings(mcore_refs, tp1_checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tp1_checkpoint, ckpt)
    (ckpt / "stale.distcp").write_bytes(b"from an older save")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([PYTHON, "-m", "sparse_rl_megatron.cli", "convert", "hf-to-megatron",
                           "--input", str(mcore_refs.parent / "qwen2_tied"), "--output", str(ckpt), "--overwrite"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not (ckpt / "stale.distcp").exists() and _snapshot(ckpt).keys() == _snapshot(tp1_checkpoint).keys()
    # what a user sees (the default warning filters): none of the seven TE/Apex/cuda-graph warnings of a CPU run
    assert "UserWarning" not in proc.stderr, proc.stderr
    for step in ("loading torch and megatron-core", "building the qwen2 model at TP=1 x PP=1",
                 "loading the HF weights of", "saving the torch_dist checkpoint"):
        assert step in proc.stderr


def test_export_names_its_dtype_and_warns_about_a_missing_tokenizer(mcore_refs, tp1_checkpoint, tmp_path, caplog,
                                                                     recwarn):
    from safetensors.torch import load_file

    from sparse_rl_megatron.learner import checkpoint
    from sparse_rl_megatron.utils.file_checks import MEGATRON_ASSETS_DIR

    assert MEGATRON_ASSETS_DIR == checkpoint.ASSETS_DIR
    source = json.loads((mcore_refs.parent / "qwen2_tied" / "config.json").read_text())
    assert source["dtype"] == "float32"
    out = tmp_path / "bf16"
    assert main(["convert", "megatron-to-hf", "--input", str(tp1_checkpoint), "--output", str(out),
                 "--dtype", "bfloat16"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config == {**source, "dtype": "bfloat16"}
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert not [w for w in recwarn if "torch.distributed is disabled" in str(w.message)]  # no_dist is the point
    assert "tokenizer" not in caplog.text

    bare = tmp_path / "no_tokenizer_ckpt"
    shutil.copytree(tp1_checkpoint, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / MEGATRON_ASSETS_DIR / name).unlink()
    assert main(["convert", "megatron-to-hf", "--input", str(bare), "--output", str(tmp_path / "bare_hf")]) == 0
    assert (f"the checkpoint {bare} carries no tokenizer files (none of tokenizer.json, tokenizer.model, vocab.json "
            f"in hf_assets/): the HF export {tmp_path / 'bare_hf'} will lack them") in caplog.text
    assert not (tmp_path / "bare_hf" / "tokenizer.json").exists()


def test_hf_source_without_tokenizer_is_warned_about_before_conversion(mcore_refs, tmp_path, caplog):
    from sparse_rl_megatron.convert_cli import check_inputs

    hf = tmp_path / "hf"
    shutil.copytree(mcore_refs.parent / "qwen2_tied", hf)
    (hf / "tokenizer.json").unlink()
    check_inputs(argparse.Namespace(direction="hf-to-megatron", input=str(hf), output=str(tmp_path / "out"),
                                    overwrite=False, tensor_parallel_size=1, pipeline_parallel_size=1))
    assert (f"--input {hf} has no tokenizer files (none of tokenizer.json, tokenizer.model, vocab.json): the checkpoint "
            "will carry none, and its HF exports will lack them") in caplog.text
