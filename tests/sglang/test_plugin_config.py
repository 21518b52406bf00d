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
    with pytest.raises(ConfigError, match="'h2o' is not supported.*valid: none, rkv, snapkv, streamingllm, triattention"):
        request_compression(base, {"method": "h2o"})
    # query centers are summed only on a server started with a method that needs them (they are sized at start)
    with pytest.raises(ConfigError, match="method 'triattention' needs query centers, which a server keeps only when "
                                          "started with such a method .it was started with 'rkv'."):
        request_compression(base, {"method": "triattention"})
    tri = CompressionConfig(method="triattention", budget=64, window=8, buffer=16)
    assert request_compression(tri, {"method": "snapkv", "budget": 32}).method == "snapkv"
    assert request_compression(tri, {"budget": 32}).budget == 32
    with pytest.raises(ConfigError, match="compression.triattention_centers=file is not supported by the SGLang "
                                          "plugin .it keeps online centers only.; set it to online"):
        request_compression(tri, {"triattention_centers": "file", "triattention_centers_path": "c.pt"})
    # a dense request (the trainer's weight probe, dense evaluation) needs no query ring: any window goes
    assert request_compression(base, {"method": "none", "window": 32, "budget": 512}).is_dense


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
    assert isinstance(plugin, SparseKVConfig) and json.loads(plugin.to_json())["kept_digest"] is False
    plugin = SGLangEngineConfig(model_path="m", kept_digest=True, check_tables=True).plugin_config()
    assert plugin.kept_digest and plugin.check_tables
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
                        ("--device", "cpu"), ("--max-total-tokens", "65536"), ("--max-running-requests", "256")]:
        assert argv[argv.index(flag) + 1] == value
    assert "--device" not in server_argv(["--model-path", "m"], on_cpu=False)


def test_launcher_reads_the_attention_backend_flags_as_sglang_does():
    from sglang_ext.launch_server import backend_flags

    assert backend_flags(["--model-path", "m", "--attention-backend=fa3", "--decode-attention-backend", "triton"]) == {
        "attention_backend": "fa3", "prefill_attention_backend": None, "decode_attention_backend": "triton"}
    assert backend_flags(server_argv(["--model-path", "m"], on_cpu=False))["attention_backend"] == "sparse_kv"


@pytest.mark.parametrize("flags", [["--attention-backend", "fa3"], ["--attention-backend=fa3"],
                                   ["--prefill-attention-backend", "fa3"], ["--decode-attention-backend=fa3"]])
def test_launcher_refuses_another_attention_backend_in_one_line_before_sglang(flags):
    """Before issue 51 ``--attention-backend fa3`` started SGLang on fa3 without the plugin, the config ignored.
    Refused before SGLang is imported (a missing model path is never looked up: nothing else is printed)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "sglang_ext.launch_server", "--sparse-kv-config",
                           '{"compression": {"method": "rkv"}}', *flags, "--model-path", "no/such-model"],
                          env=env, capture_output=True, text=True, timeout=120)
    flag = flags[0].split("=")[0][2:].replace("-", "_")
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith(f"error: {flag}=fa3: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert 'put "fa3" in the config\'s inner_backend' in proc.stderr


def test_the_launcher_needs_nothing_from_the_rollout_package():
    """The plugin owns its CPU defaults: launching a server imports the plugin, not the trainer's rollout code."""
    import subprocess
    import sys

    code = ("import sys, sglang_ext.launch_server; "
            "print([m for m in sys.modules if m.startswith('sparse_rl_megatron.rollout')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_trainer_section_and_recipes():
    """``rollout.sglang`` in ``sparse-rl train``: SGLangEngineConfig's fields minus what the run gives (model,
    compression, dtype); every shipped recipe names the sglang engine and builds its config."""
    from pathlib import Path

    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.utils.config_io import load_config

    recipes = sorted((Path(__file__).resolve().parents[2] / "configs" / "recipes").glob("qwen2.5-*/*.yaml"))
    assert len(recipes) == 12
    for recipe in recipes:
        rollout = load_config(TrainConfig, recipe).rollout
        engine = rollout.sglang_config("/models/m")
        assert rollout.engine == "sglang" and engine.model_path == "/models/m" and engine.dtype == "bfloat16"
        assert engine.compression == rollout.compression and engine.memory_saver
    cfg = load_config(TrainConfig, None, ["rollout.engine=sglang", "rollout.sglang.urls=[http://h:1]",
                                          "rollout.sglang.weight_sync=distributed"])
    assert cfg.rollout.sglang_config("/m").urls == ["http://h:1"]
    for overrides, message in [
        (["rollout.engine=sglang", "rollout.sglang.weight_sync=nccl"],
         "rollout.sglang: SGLangEngineConfig.weight_sync must be one of tensor, distributed, disk"),
        (["rollout.engine=sglang", "rollout.sglang.model_path=/x"], "rollout.sglang: unknown key.s. model_path"),
        (["rollout.engine=sglang", "rollout.compression.method=h2o"], "rollout: .*'h2o' is not supported"),
        (["rollout.sglang.max_total_tokens=1024"], "rollout: sglang options are set, but engine is 'hf'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, None, overrides)
