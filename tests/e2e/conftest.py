"""Fixtures shared by the whole-command tests."""
import pytest

from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random tiny Qwen2 HF directory (config, safetensors, tokenizer), built once per session."""
    return save_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "model", "qwen2", seed=0)
