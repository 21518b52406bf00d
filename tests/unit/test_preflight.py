"""Start-up checks name the option and the file at fault in one line."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from sparse_rl_megatron.utils.config_io import ConfigError, load_config
from sparse_rl_megatron.utils.errors import UserError
from sparse_rl_megatron.utils.preflight import check_model_dir, check_new_output


def test_model_dir_checks(tmp_path):
    with pytest.raises(UserError, match=r"^model_path: .*/nope does not exist$"):
        check_model_dir(tmp_path / "nope", "model_path")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is not a directory"):
        check_model_dir(tmp_path / "file", "--model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"^--model: .*/empty has no config.json"):
        check_model_dir(empty, "--model")
    (empty / "config.json").write_text('{"model_type": "qwen2",\n "x": }')
    with pytest.raises(UserError, match=r"empty/config.json is not valid JSON \(.* at line 2"):
        check_model_dir(empty, "--model")
    (empty / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(UserError, match="has a config.json but no \\*.safetensors weights"):
        check_model_dir(empty, "--model")
    (empty / "model.safetensors").write_bytes(b"")
    assert check_model_dir(empty, "--model") == {"model_type": "qwen2"}


def test_megatron_checkpoint_metadata_is_checked(tmp_path):
    (tmp_path / "sparse_rl_checkpoint.json").write_text("{broken")
    with pytest.raises(UserError, match="sparse_rl_checkpoint.json is not valid JSON"):
        check_model_dir(tmp_path, "model_path")
    (tmp_path / "sparse_rl_checkpoint.json").write_text('{"hf_config": {"model_type": "llama"}}')
    assert check_model_dir(tmp_path, "model_path") == {"model_type": "llama"}


def test_new_output(tmp_path):
    assert check_new_output(tmp_path / "new", "--output") == tmp_path / "new"
    assert check_new_output(tmp_path, "--output") == tmp_path  # empty directory
    (tmp_path / "a").write_text("x")
    with pytest.raises(UserError, match=r"^--output: .* already exists and is not empty; .*--overwrite"):
        check_new_output(tmp_path, "--output")
    assert check_new_output(tmp_path, "--output", overwrite=True) == tmp_path


@dataclass
class Recipe:
    name: str = "run"
    budget: list[int] = field(default_factory=list)


def test_malformed_or_missing_recipe_names_the_file(tmp_path):
    bad = tmp_path / "recipe.yaml"
    bad.write_text("name: x\nbudget: [1, 2\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml: malformed YAML: .* at line \d+, column \d+"):
        load_config(Recipe, bad)
    with pytest.raises(ConfigError, match=r"config file .*/missing.yaml does not exist"):
        load_config(Recipe, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"^override 'name=\[1': the value is not valid YAML \("):
        load_config(Recipe, None, ["name=[1"])


def test_cli_prints_a_user_error_as_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sparse_rl_megatron.cli", "train", "--config", str(tmp_path / "x.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "config file" in out.stderr and "x.yaml does not exist" in out.stderr
    assert "Traceback" not in out.stderr
