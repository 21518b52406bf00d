"""``sparse-rl train`` refuses a bad recipe, option or file with one line naming it, before any model loads
(nothing is written to the run directory)."""
from __future__ import annotations

from pathlib import Path

import pytest
from cli_fixtures import write_cli_inputs

from sparse_rl_megatron.cli import main


@pytest.fixture
def files(tmp_path):
    write_cli_inputs(tmp_path)
    (tmp_path / "bad.yaml").write_text("steps: 3\nrollout:\n  prompts_per_step: [4\n")
    return tmp_path


CASES = [
    (["--config", "{d}/bad.yaml"], r"{d}/bad.yaml: malformed YAML: .* at line \d+, column \d+"),
    (["learner.tp=2"], r"learner: unknown key\(s\) tp; valid keys: batch_layout, "),
    (["learner.tensor_parallel_size=3"], r"learner.tensor_parallel_size x learner.pipeline_parallel_size = 3 x 1 = 3 "
                                         r"does not divide the world size 2"),
    (["data.template=chatml"], r"data.template: unknown prompt template 'chatml'; valid names: "),
    (["data.dataset=mathh"], r"data.dataset: 'mathh' is neither a named data set \(valid names: "),
    (["data.dataset=gsm8k_train", "data.data_root={d}/nowhere"], r"data.dataset: data set 'gsm8k_train' expects "
                                                                  r"{d}/nowhere/train/gsm8k/train.jsonl, .*data.data_root"),
    (["data.dataset={d}/empty.jsonl"], r"data.dataset: data file {d}/empty.jsonl has no usable rows"),
    (["data.dataset={d}/nolabel.jsonl"], r"data.dataset: data file {d}/nolabel.jsonl has no usable rows \(1 malformed"),
    (["model_path={d}/missing"], r"model_path: {d}/missing does not exist"),
    (["model_path={d}"], r"model_path: {d} has no config.json"),
    (["rollout.samples_per_prompt=1", "global_batch_size=null"], r"rollout.samples_per_prompt=1 with correction.advantage_estimator='drgrpo' "),
    (["plugins=[no_such_plugin_module]"], r"plugins\[0\]: cannot import 'no_such_plugin_module'"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input_is_one_line_before_any_model_loads(files, capsys, monkeypatch, args, message):
    import re

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 would announce
    run_dir = files / "run"
    base = [f"run_dir={run_dir}", f"model_path={files / 'model'}", f"data.dataset={files / 'data.jsonl'}",
            "eval.datasets=[]"]
    argv = [a.format(d=files) for a in args]
    if argv[0] == "--config":
        argv = argv[:2] + base + argv[2:]
    else:
        argv = base + argv
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.match(r"sparse-rl train: error: " + message.format(d=re.escape(str(files))), err[0]), err[0]
    assert not run_dir.exists()  # refused before the run directory (or any model) was touched


def test_corrupt_model_config_names_the_file(files, capsys):
    (files / "model" / "config.json").write_text('{"model_type": "qwen2", "hidden_size": }')
    assert main(["train", f"run_dir={files / 'run'}", f"model_path={files / 'model'}",
                 f"data.dataset={files / 'data.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert f"sparse-rl train: error: {files / 'model' / 'config.json'} is not valid JSON" in err


@pytest.mark.parametrize("local_rank,relayed,printed", [("0", False, True), ("1", False, True), ("1", True, False),
                                                         ("0", True, False)])
def test_a_run_failure_is_one_line_printed_by_the_rank_it_happened_on(files, capsys, monkeypatch, local_rank,
                                                                      relayed, printed):
    from sparse_rl_megatron.trainer import loop
    from sparse_rl_megatron.utils.errors import RunFailed, UserError

    def failing_train(cfg):
        if relayed:  # what every other rank raises when rank 0 failed (distributed.on_main)
            err = UserError("the SGLang engine's process scheduler_0 (pid 7) was killed by signal SIGKILL")
            err.relayed_from_main, err.exit_code = True, 1
            raise err
        raise RunFailed("saving checkpoint run/checkpoints/step_2 failed on rank 1: [Errno 28] No space left on device")

    monkeypatch.setattr(loop, "train", failing_train)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    code = main(["train", f"run_dir={files / 'run'}", f"model_path={files / 'model'}",
                 f"data.dataset={files / 'data.jsonl'}", "eval.datasets=[]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == (1 if printed else 0), err
    if printed:
        assert err[0].startswith("sparse-rl train: error: saving checkpoint run/checkpoints/step_2 failed")
