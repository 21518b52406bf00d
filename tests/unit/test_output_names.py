"""Default output names are informative (a checkpoint's parent folder, the inference mode) and never replace
an earlier output: the first free numbered variant is taken."""
from sparse_rl_megatron.eval.results import default_results_name
from sparse_rl_megatron.utils.file_checks import first_free_path


def test_default_results_name_tells_checkpoints_apart():
    assert default_results_name("/runs/a/step_100/checkpoint", "rkv-B512-W128") == (
        "eval-step_100_checkpoint-rkv-B512-W128.json")
    assert default_results_name("/runs/a/step_200/checkpoint/", "dense") == "eval-step_200_checkpoint-dense.json"
    assert default_results_name("/models/Qwen2.5 3B", "dense") == "eval-models_Qwen2.5_3B-dense.json"
    assert default_results_name("/model", "dense") == "eval-model-dense.json"


def test_first_free_path_numbers_instead_of_replacing(tmp_path):
    base = tmp_path / "eval-x-dense.json"
    assert first_free_path(base) == base
    base.write_text("first")
    assert first_free_path(base) == tmp_path / "eval-x-dense-2.json"
    (tmp_path / "eval-x-dense-2.json").write_text("second")
    assert first_free_path(base) == tmp_path / "eval-x-dense-3.json"
    (tmp_path / "eval-x-dense-3.png").write_text("")  # a companion file takes the name too
    assert first_free_path(base, (".png",)) == tmp_path / "eval-x-dense-4.json"
    assert base.read_text() == "first"
