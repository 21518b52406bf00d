"""The sparse_kv configuration alone (no engine): sources, per-request overrides, errors naming the field."""
from __future__ import annotations

import json

import pytest

from sglang_ext.config import SparseKVConfig, parse_config, request_compression
from sglang_ext.launch_server import server_argv
from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
from sparse_rl_megatron.utils.config_io import ConfigError, from_dict


def test_json_and_yaml_sources(tmp_path):
    text = '{"compression": {"method": "snapkv", "budget": 64, "window": 4, "buffer": 16}, "kept_digest": true}'
    config = parse_config(text)
    assert config.compression.method == "snapkv" and config.kept_digest and config.free_evicted
    path = tmp_path / "kv.yaml"
    path.write_text("compression:\n  method: rkv\n  scope: response\n")
    assert parse_config(str(path)).compression.scope == "response"
    assert parse_config(config.to_json()) == config


@pytest.mark.parametrize("text,message", [
    ("{not json", "SPARSE_RL_KV_CONFIG: not valid JSON"),
    ("/no/such/file.yaml", "is neither a JSON object nor an existing .json/.yaml file"),
    ('{"compression": {"scope": "prompt"}}', "sparse_kv.compression: CompressionConfig.scope must be one of"),
    ('{"inner_backend": "flashmla"}', "inner_backend must be one of torch_native, triton, flashinfer, fa3"),
    ('{"compression": {"method": "rkv", "trigger_on_newline": true}}', "trigger_on_newline is not supported"),
])
def test_errors_name_the_field(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_config(text)


def test_request_overrides_stay_within_the_server():
    base = CompressionConfig(method="rkv", budget=64, window=8, buffer=16)
    assert request_compression(base, None) is base
    small = request_compression(base, {"method": "streamingllm", "budget": 32, "sink_tokens": 2})
    assert (small.method, small.budget, small.window, small.buffer) == ("streamingllm", 32, 8, 16)
    with pytest.raises(ConfigError, match="window .16. exceeds the server's window .8."):
        request_compression(base, {"window": 16})
    with pytest.raises(ConfigError, match="budget \\+ buffer .96. exceeds the server's .80."):
        request_compression(base, {"budget": 80})
    with pytest.raises(ConfigError, match="custom_params.sparse_kv: unknown key.s. bugdet"):
        request_compression(base, {"bugdet": 8})
    with pytest.raises(ConfigError, match="'h2o' is not supported by the SGLang plugin"):
        request_compression(base, {"method": "h2o"})


def test_engine_config_is_checked_early():
    with pytest.raises(ValueError, match="model_path is required"):
        SGLangEngineConfig()
    with pytest.raises(ValueError, match="'tensor' needs the in-process engine"):
        SGLangEngineConfig(urls=["http://x"])
    with pytest.raises(ValueError, match="weight_sync_dir is required"):
        SGLangEngineConfig(model_path="m", weight_sync="disk")
    with pytest.raises(ValueError, match="'h2o' is not supported"):
        SGLangEngineConfig(model_path="m", compression=CompressionConfig(method="h2o"))
    plugin = SGLangEngineConfig(model_path="m", compression=CompressionConfig(method="rkv")).plugin_config()
    assert isinstance(plugin, SparseKVConfig) and json.loads(plugin.to_json())["kept_digest"] is True
    # the trainer builds it from YAML with the project's config loader; errors name the dotted field
    built = from_dict(SGLangEngineConfig, {"urls": ["http://a:1"], "weight_sync": "distributed",
                                           "compression": {"method": "snapkv", "budget": 256}})
    assert built.compression.budget == 256 and built.urls == ["http://a:1"]
    with pytest.raises(ConfigError, match="rollout.compression.budget: expected int"):
        from_dict(SGLangEngineConfig, {"model_path": "m", "compression": {"budget": "big"}}, path="rollout")


def test_launcher_adds_what_the_plugin_needs_unless_given():
    argv = server_argv(["--model-path", "m", "--page-size=1"], on_cpu=True)
    assert argv.count("--page-size=1") == 1 and "--page-size" not in argv
    for flag, value in [("--attention-backend", "sparse_kv"), ("--cuda-graph-backend-decode", "disabled"),
                        ("--device", "cpu"), ("--max-total-tokens", "65536")]:
        assert argv[argv.index(flag) + 1] == value
    assert "--device" not in server_argv(["--model-path", "m"], on_cpu=False)
