"""``sparse-rl mismatch`` refuses bad options, recipes and files with one line naming them, before any model loads
(nothing is written: no run directory, no results); its shorthand flags are train-config fields."""
from __future__ import annotations

import argparse
import re

import pytest
from cli_fixtures import write_cli_inputs

from sparse_rl_megatron.cli import main
from sparse_rl_megatron.mismatch.cli import FLAG_FIELDS, add_arguments, flag_overrides


@pytest.fixture
def files(tmp_path):
    write_cli_inputs(tmp_path)
    (tmp_path / "taken.json").write_text("{}")
    (tmp_path / "taken.png").write_bytes(b"")
    (tmp_path / "free.json").mkdir()
    return tmp_path


# the CPU default's compression is rkv B=8, window 2
CASES = [
    (["--budgets", "16,abc"], r"--budgets: 'abc' is not a positive whole number; give budgets like 64,128,256"),
    (["--budgets", "16,0"], r"--budgets: '0' is not a positive whole number"),
    (["--budgets", "16,16"], r"--budgets: 16 is given twice"),
    (["--budgets", "16,2"], r"--budgets: CompressionConfig.budget must be > window .* got budget=2, window=2"),
    (["--compression", "none"], r"rollout.compression.method is 'none' \(dense\): name the compressor to study with "
                                r"--compression \(valid: h2o, rkv, snapkv, streamingllm, triattention\)"),
    (["--compression", "zip"], r"rollout.compression: CompressionConfig.method: unknown KV compression method 'zip'; "
                               r"valid names: "),
    (["--prompts", "0"], r"rollout.*prompts_per_step must be >= 1, got 0"),
    (["--output", "{d}/taken.json", "--plot", "--model", "{d}/missing"],
     r"model_path: {d}/missing does not exist"),  # an explicit --output is written as given: the next check speaks
    (["--output", "{d}/free.json"], r"--output: {d}/free.json is a directory; give the results file's path"),
    (["--dataset", "{d}/empty.jsonl"], r"data.dataset: data file {d}/empty.jsonl has no usable rows"),
    (["--model", "{d}/missing"], r"model_path: {d}/missing does not exist"),
    # the study takes no optimizer step: the recipe's global batch (32) need not divide 3 x 8 samples
    (["--prompts", "3", "--model", "{d}/missing"], r"model_path: {d}/missing does not exist"),
    (["learner.tensor_parallel_size=3"], r"learner.tensor_parallel_size x learner.pipeline_parallel_size = 3 x 1 = 3 "
                                         r"does not divide the world size 2"),
    (["data.template=chatml"], r"data.template: unknown prompt template 'chatml'; valid names: "),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(c[0])[:40] for c in CASES])
def test_bad_input_is_one_line_before_any_model_loads(files, capsys, monkeypatch, args, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 would announce
    run_dir = files / "run"
    argv = [f"run_dir={run_dir}", "--model", str(files / "model"), "--dataset", str(files / "data.jsonl"),
            *(a.format(d=files) for a in args)]
    assert main(["mismatch", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.match(r"sparse-rl mismatch: error: " + message.format(d=re.escape(str(files))), err[0]), err[0]
    assert not run_dir.exists()  # refused before the run directory (or any model) was touched
    assert (files / "taken.json").read_text() == "{}"


def test_default_results_name_never_replaces_an_earlier_study(tmp_path):
    """The rule eval follows too: the default name is numbered when taken (by the JSON or, with --plot, the PNG);
    --overwrite lets it replace; an explicit --output is written as given."""
    from sparse_rl_megatron.mismatch.cli import output_paths

    cfg = argparse.Namespace(run_dir=str(tmp_path), rollout=argparse.Namespace(
        compression=argparse.Namespace(method="rkv")))

    def paths(**kw):
        return output_paths(argparse.Namespace(**{"output": None, "overwrite": False, "plot": True, **kw}), cfg,
                            [12, 24])

    first = tmp_path / "mismatch" / "rkv-B12-24.json"
    assert paths() == (first, first.with_suffix(".png"))
    first.parent.mkdir()
    first.with_suffix(".png").write_bytes(b"")  # a PNG alone takes the name
    second = first.with_name("rkv-B12-24-2.json")
    assert paths() == (second, second.with_suffix(".png"))
    assert paths(plot=False) == (first, None)
    assert paths(overwrite=True) == (first, first.with_suffix(".png"))
    assert paths(output=str(tmp_path / "mine.json")) == (tmp_path / "mine.json", tmp_path / "mine.png")


def test_flags_are_train_config_fields_and_come_after_the_overrides():
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.utils.config_io import load_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["rollout.prompts_per_step=7", "--compression", "snapkv", "--samples", "3",
                              "rollout.compression.window=2", "--max-new-tokens", "9", "--model", "tiny", "--seed",
                              "5", "--prompts", "2", "--dataset", "gsm8k_train", "--template", "plain"])
    assert args.overrides == ["rollout.prompts_per_step=7", "rollout.compression.window=2"]  # intermixed
    overrides = flag_overrides(args)
    assert overrides == ["model_path=tiny", "data.dataset=gsm8k_train", "data.template=plain",
                         "rollout.compression.method=snapkv", "rollout.prompts_per_step=2",
                         "rollout.samples_per_prompt=3", "rollout.sampling.max_new_tokens=9", "seed=5"]
    cfg = load_config(TrainConfig, None, [*args.overrides, *overrides])
    assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.rollout.compression.method) == (
        2, 3, "snapkv")
    assert set(FLAG_FIELDS) == {a.dest for a in parser._actions if a.dest in FLAG_FIELDS}
