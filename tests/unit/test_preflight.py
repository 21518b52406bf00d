"""Start-up checks name the option and the file at fault in one line."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from sparse_rl_megatron.utils.config_io import ConfigError, load_config
from sparse_rl_megatron.utils.errors import UserError
from sparse_rl_megatron.utils.file_checks import check_model_dir, check_new_output


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


# ------------------------------------------------------------------ limits checked before any model loads
def _model_dir(path, context: int, tokenizer: bool = True):
    """An HF directory that passes the file checks (config + empty weights; nothing loads them), with the tiny
    tokenizer, for a model of ``context`` positions."""
    import json

    from sparse_rl_megatron.models.tiny import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
              "max_position_embeddings": context}
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    if tokenizer:
        build_tiny_tokenizer().save_pretrained(path)
    return path


def _train_cfg(tmp_path, context: int = 1024, tokenizer: bool = True, overrides: tuple[str, ...] = ()):
    from sparse_rl_megatron.trainer.config import TrainConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "What is 2 + 3 * 4 - 5?", "answer": "9"}\n')
    model = _model_dir(tmp_path / "m", context, tokenizer)
    return load_config(TrainConfig, None, [f"model_path={model}", f"run_dir={tmp_path / 'run'}",
                                           f"data.dataset={data}", *overrides])


def _longest_prompt(model_dir) -> int:
    """As the engines count it: the directory's tokenizer (AutoTokenizer reads the model type from config.json)."""
    from transformers import AutoTokenizer

    from sparse_rl_megatron.data.templates import render_prompt

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return max(len(tok(render_prompt("qwen25_chat", p, tok), add_special_tokens=False)["input_ids"])
               for p in ("1+1?", "What is 2 + 3 * 4 - 5?"))


def test_rollout_length_must_fit_the_models_context(tmp_path):
    from sparse_rl_megatron.trainer.run_plan import preflight

    prompt = _longest_prompt(_model_dir(tmp_path / "m", 256))
    fits = 256 - prompt  # prompt + max_new_tokens == context: SGLang accepts it (it refuses a total past it)
    preflight(_train_cfg(tmp_path, 256, overrides=(f"rollout.sampling.max_new_tokens={fits}",)), 1, on_gpu=False)
    cfg = _train_cfg(tmp_path, 256, overrides=(f"rollout.sampling.max_new_tokens={fits + 1}",))
    with pytest.raises(UserError, match=rf"^rollout.sampling.max_new_tokens={fits + 1} \+ the longest prompt of "
                                        rf"data.dataset .*d.jsonl \({prompt} tokens\) = 257 > 256 tokens, the model's "
                                        rf"context \(max_position_embeddings of .*/m\); set "
                                        rf"rollout.sampling.max_new_tokens to at most {fits}$"):
        preflight(cfg, 1, on_gpu=False)
    # without a tokenizer in the directory the prompts are not measured: max_new_tokens alone
    cfg = _train_cfg(tmp_path / "b", 256, tokenizer=False, overrides=("rollout.sampling.max_new_tokens=257",))
    with pytest.raises(UserError, match=r"^rollout.sampling.max_new_tokens=257 > 256 tokens, the model's context"):
        preflight(cfg, 1, on_gpu=False)


def test_every_evaluation_length_must_fit(tmp_path):
    from sparse_rl_megatron.trainer.run_plan import preflight

    evals = tmp_path / "heldout.jsonl"
    evals.write_text('{"prompt": "3+3?", "answer": "6"}\n')
    cfg = _train_cfg(tmp_path, 256, overrides=(f"eval.datasets=[{evals}]", "eval.max_new_tokens=250",
                                               "rollout.sampling.max_new_tokens=8"))
    with pytest.raises(UserError, match=r"^eval.max_new_tokens=250 \+ the longest prompt of eval.datasets "
                                        r".*heldout.jsonl \(\d+ tokens\) = \d+ > 256 tokens, .*; set "
                                        r"eval.max_new_tokens to at most \d+$"):
        preflight(cfg, 1, on_gpu=False)
    # unset: the evaluation uses the rollout's length
    cfg = _train_cfg(tmp_path, 256, overrides=(f"eval.datasets=[{evals}]", "rollout.sampling.max_new_tokens=8"))
    assert preflight(cfg, 1, on_gpu=False).eval_data


def test_the_sglang_engines_context_length_is_a_limit_too(tmp_path):
    from sparse_rl_megatron.trainer.run_plan import preflight

    cfg = _train_cfg(tmp_path, overrides=("rollout.engine=sglang", "rollout.sglang.extra_args={context_length: 64}",
                                          "rollout.sampling.max_new_tokens=60"))
    with pytest.raises(UserError, match=r"^rollout.sampling.max_new_tokens=60 \+ .* > 64 tokens, the engine's "
                                        r"context \(rollout.sglang.extra_args.context_length\); set "):
        preflight(cfg, 1, on_gpu=False)


def test_a_16_bit_learner_needs_a_gpu(tmp_path):
    from sparse_rl_megatron.trainer.run_plan import preflight

    cfg = _train_cfg(tmp_path, overrides=("learner.params_dtype=bfloat16",))
    with pytest.raises(UserError, match=r"^learner.params_dtype=bfloat16 needs a GPU: this machine has no CUDA "
                                        r"device.*; set learner.params_dtype=float32"):
        preflight(cfg, 1, on_gpu=False)
    assert preflight(cfg, 1, on_gpu=True).train_data  # on GPUs it is the recipes' dtype
    preflight(_train_cfg(tmp_path, overrides=("learner.params_dtype=auto",)), 1, on_gpu=False)
    assert preflight(cfg, 1, on_gpu=False, training=False).train_data  # log-probs only (sparse-rl mismatch): bf16 on CPU


def test_the_expert_layout_is_checked_before_any_model_loads(tmp_path):
    """A mixture of experts (``tiny-qwen3-moe``: 4 experts of width 64): an EP that does not divide the experts, an EP
    x expert TP that does not divide a stage's ranks, training at TP 2 without sequence parallel, and EP on a dense
    model are one line each, naming the field and the valid values."""
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.trainer.run_plan import check_model

    def cfg(*overrides):
        return load_config(TrainConfig, None, ["model_path=tiny-qwen3-moe", f"run_dir={tmp_path / 'run'}", *overrides])

    with pytest.raises(UserError, match=r"^learner: expert_parallel_size=3 does not divide num_experts=4 of this "
                                        r"qwen3_moe model; valid expert_parallel_size values: \[1, 2, 4\]"):
        check_model(cfg("learner.expert_parallel_size=3"), 3)
    with pytest.raises(UserError, match=r"^learner.expert_parallel_size x learner.expert_tensor_parallel_size = 4 x 1 "
                                        r"\(null: the TP size\) does not divide the ranks of one pipeline stage, "
                                        r"world size / learner.pipeline_parallel_size = 4 / 2 = 2"):
        check_model(cfg("learner.expert_parallel_size=4", "learner.pipeline_parallel_size=2"), 4)
    with pytest.raises(UserError, match=r"tensor_parallel_size=2 with the mixture of experts of this qwen3_moe model "
                                        r"trains only with megatron_overrides.sequence_parallel=True"):
        check_model(cfg("learner.tensor_parallel_size=2", "learner.expert_parallel_size=2"), 4)
    with pytest.raises(UserError, match=r"expert_parallel_size=2 needs a mixture-of-experts model; this qwen2 model "
                                        r"is dense"):
        check_model(cfg("model_path=tiny", "learner.expert_parallel_size=2"), 2)
    check_model(cfg("learner.expert_parallel_size=2", "learner.pipeline_parallel_size=2"), 4)  # PP 2 x EP 2 is fine
