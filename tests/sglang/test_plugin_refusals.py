"""Settings the plugin cannot serve are refused when the server starts, in one line naming the flag; every method
the AttentionBackend base class leaves raising is implemented by the plugin or belongs to a refused feature."""
from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
from sglang_helpers import resolved_server_args, scheduler_env

from sparse_rl_megatron.utils.config_io import ConfigError

RKV = {"method": "rkv", "budget": 8, "window": 2, "buffer": 4}


FEATURES = {   # a setting that turns the feature on -> the flag the refusal names
    "attention DP": ({"attn_dp_size": 2, "tp_size": 2}, "attn_dp_size=2: attention data parallelism"),
    "attention DP, deprecated flag": ({"dp_size": 2, "enable_dp_attention": True, "tp_size": 2},
                                      "enable_dp_attention=True: attention data parallelism"),
    "decode CP": ({"dcp_size": 2, "tp_size": 2}, "dcp_size=2: decode context parallelism"),
    "attention CP": ({"attn_cp_size": 2, "tp_size": 2}, "attn_cp_size=2: attention context parallelism"),
    "prefill CP": ({"enable_prefill_cp": True, "cp_strategy": "zigzag"}, "enable_prefill_cp=True"),
    "unified memory": ({"enable_unified_memory": True}, "enable_unified_memory=True: unified memory"),
    "two-batch overlap": ({"enable_two_batch_overlap": True}, "enable_two_batch_overlap=True: two-batch overlap"),
    "PD multiplexing": ({"enable_pdmux": True}, "enable_pdmux=True: PD multiplexing"),
    "speculative decoding": ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm=EAGLE: speculative"),
    "mixed prefill/decode chunks": ({"enable_mixed_chunk": True}, "enable_mixed_chunk=True"),
    "CUDA graphs": ({"disable_cuda_graph": False}, "does not support CUDA graphs"),
    "breakable CUDA graphs": ({"disable_cuda_graph": False, "cuda_graph_backend_decode": "disabled",
                               "cuda_graph_backend_prefill": "breakable"}, "breakable ones included"),
    # the legacy flag is overridden by SGLang's per-phase flags and its JSON config (resolved per phase)
    "CUDA graphs, per-phase decode flag": ({"disable_cuda_graph": True, "cuda_graph_backend_decode": "full"},
                                           "resolved: decode full, prefill disabled"),
    "CUDA graphs, JSON config": ({"disable_cuda_graph": True, "cuda_graph_config": {"decode": {"backend": "full"}}},
                                 "resolved: decode full, prefill disabled"),
    "pipeline parallelism": ({"pp_size": 2}, "pp_size=2: pipeline parallelism"),
    "MoE all-to-all": ({"moe_a2a_backend": "deepep"}, "moe_a2a_backend=deepep"),
    # issue 41: accepted before, then wrong (sessions, returned indexer top-k) or a failure at model load (torch.compile);
    # returned routed experts are refused per compressed request (tests/sglang/test_sglang_moe.py)
    "streaming sessions": ({"enable_streaming_session": True}, "enable_streaming_session=True: streaming sessions"),
    "returned indexer top-k": ({"enable_return_indexer_topk": True},
                               "enable_return_indexer_topk=True: returning indexer top-k"),
    "torch.compile": ({"enable_torch_compile": True}, "enable_torch_compile=True: torch.compile"),
    # issue 51: external KV tiers (refused as HiCache is: they store and reload pool slots), accepted before
    "LMCache": ({"enable_lmcache": True}, "enable_lmcache=True: LMCache"),
    "FlexKV": ({"enable_flexkv": True}, "enable_flexkv=True: FlexKV"),
    "external linker": ({"enable_unified_cache_external_linker": True},
                        "enable_unified_cache_external_linker=True: the unified cache's external KV store"),
    "radix cache backend": ({"radix_cache_backend": "flexkv"}, "radix_cache_backend=flexkv: a registered radix-cache"),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_refused_at_start_in_one_line_naming_the_flag(tiny_model_dir, feature):
    overrides, message = FEATURES[feature]
    with pytest.raises(ConfigError) as err:
        resolved_server_args(tiny_model_dir, {"compression": RKV}, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides,message", [
    ({"attention_backend": "torch_native"},
     "attention_backend=torch_native: a sparse_kv config (--sparse-kv-config / SPARSE_RL_KV_CONFIG) is served by the "
     "sparse_kv attention backend only"),
    # both phases another: the per-phase flags win over --attention-backend sparse_kv (the launcher adds it)
    ({"prefill_attention_backend": "torch_native", "decode_attention_backend": "torch_native"},
     "prefill_attention_backend=torch_native: "),
    ({"decode_attention_backend": "fa3"}, "decode_attention_backend=fa3: "),
    ({"attention_backend": None}, "attention_backend=None: "),   # SGLang's default is another backend
])
def test_another_attention_backend_beside_a_sparse_kv_config_is_refused(tiny_model_dir, overrides, message):
    """Before issue 51 a sparse_kv config beside another backend was ignored without a word: SGLang served dense."""
    with pytest.raises(ConfigError) as err:
        resolved_server_args(tiny_model_dir, {"compression": RKV}, **overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
    value = next(iter(overrides.values()))
    fix = f'put "{value}" in the config\'s inner_backend' if value else "pass --attention-backend sparse_kv"
    assert fix in str(err.value), str(err.value)


def test_the_resolved_backends_are_checked_too(tiny_model_dir):
    """After SGLang's resolution both phases must still be sparse_kv (``refuse_other_backend(resolved=True)``)."""
    from sglang_ext.refusals import refuse_other_backend

    args = resolved_server_args(tiny_model_dir, None, attention_backend="torch_native")   # no config: SGLang's own
    with pytest.raises(ConfigError, match=r"^prefill_attention_backend=torch_native \(resolved\): "):
        refuse_other_backend(args, resolved=True)


def test_resolved_values_are_checked_too(tiny_model_dir):
    """SGLang rewrites --enable-dp-attention into attn_dp_size and clears it (the old check read the cleared flag):
    the resolved check sees the width. Resolved here under another backend, so only the resolved check runs."""
    from sglang_ext.config import SparseKVConfig
    from sglang_ext.refusals import validate_server_args

    args = resolved_server_args(tiny_model_dir, None, attention_backend="torch_native", dp_size=2,
                                enable_dp_attention=True, tp_size=2)
    from sglang.srt.arg_groups.overrides import resolved_view

    assert not resolved_view(args).enable_dp_attention and resolved_view(args).attn_dp_size == 2
    with pytest.raises(ConfigError, match="attn_dp_size=2: attention data parallelism"):
        validate_server_args(args, SparseKVConfig())


def test_good_settings_resolve_to_what_the_backend_runs_with(tiny_model_dir):
    from sglang_ext.config import CONFIG_ENV, config_from_env
    from sglang_ext.refusals import validate_server_args

    args = resolved_server_args(tiny_model_dir, {"compression": RKV, "kept_digest": True})
    assert (args.attention_backend, args.page_size, args.kv_cache_dtype) == ("sparse_kv", 1, "auto")
    with scheduler_env(**{CONFIG_ENV: json.dumps({"compression": RKV, "kept_digest": True})}):
        config = validate_server_args(args, config_from_env())
    assert config.kept_digest and config.compression.method == RKV["method"]
    assert config.compression.budget == RKV["budget"]
    # plain DP: a scheduler (and a backend) per replica
    assert resolved_server_args(tiny_model_dir, {"compression": RKV}, dp_size=2).dp_size == 2


def _raising_methods(cls) -> list[str]:
    names = []
    for name, fn in vars(cls).items():
        if callable(fn) and not name.startswith("__"):
            source = inspect.getsource(fn)
            body = source.split('"""')[-1] if source.count('"""') >= 2 else source
            if "raise NotImplementedError" in body:
                names.append(name)
    return sorted(names)


def test_every_raising_base_method_is_implemented_or_its_feature_refused(tiny_model_dir):
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    from sglang_ext.backend import UNSUPPORTED_BASE_METHODS, SparseKVBackend

    raising = _raising_methods(AttentionBackend)
    assert {"get_cuda_graph_seq_len_fill_value", "forward_decode", "init_cuda_graph_state"} <= set(raising)
    for name in raising:
        if name in UNSUPPORTED_BASE_METHODS:
            assert name not in vars(SparseKVBackend), name
            overrides, message = FEATURES[UNSUPPORTED_BASE_METHODS[name]]
            with pytest.raises(ConfigError, match=message.split(":")[0].replace("(", r"\(")):
                resolved_server_args(tiny_model_dir, {"compression": RKV}, **overrides)
        else:
            assert getattr(SparseKVBackend, name) is not getattr(AttentionBackend, name), f"{name} not implemented"


def test_fill_values_and_one_backend_per_process():
    from plugin_rig import PluginRig

    from sglang_ext.config import SparseKVConfig

    rig = PluginRig(SparseKVConfig())
    try:
        assert rig.backend.get_cuda_graph_seq_len_fill_value() == 1    # torch_native names none: 1, as the others
        assert rig.backend.get_cpu_graph_seq_len_fill_value() == 1
        with pytest.raises(ConfigError, match="a second sparse_kv attention backend was built in this process"):
            PluginRig(SparseKVConfig())
    finally:
        rig.close()
    PluginRig(SparseKVConfig()).close()   # once the first is closed, another may be built


def _model_dir(tiny_model_dir, tmp_path, name: str, **config) -> str:
    """The tiny model's directory with its ``config.json`` changed (SGLang reads only the config at this stage)."""
    out = tmp_path / name
    shutil.copytree(tiny_model_dir, out)
    data = json.loads((out / "config.json").read_text())
    data.update(config)
    (out / "config.json").write_text(json.dumps(data))
    return str(out)


HYBRID_LINEAR = dict(   # a Qwen3-Next config: linear-attention (gated delta net) layers beside full attention
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", head_dim=16, num_experts=0,
    layer_types=["linear_attention", "full_attention"], full_attention_interval=2, linear_num_value_heads=2,
    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)


@pytest.mark.parametrize("model,message", [
    ({"is_hybrid_swa": True}, "is_hybrid_swa=True: a hybrid sliding-window model"),
    (HYBRID_LINEAR, "ssm_state=Qwen3NextForCausalLM: a hybrid linear-attention / state-space model"),
])
def test_sliding_window_and_hybrid_models_are_refused_when_the_arguments_are_resolved(tiny_model_dir, tmp_path,
                                                                                       model, message):
    """Read from the model's config before any model loads (before issue 41: at the first forward, or an
    AttributeError at model load; on CPU SGLang's own resolution rejects the hybrid linear model first, with a
    message about Mamba cache snapshots)."""
    path = _model_dir(tiny_model_dir, tmp_path, "model", **model)
    with pytest.raises(ConfigError) as err:
        resolved_server_args(tiny_model_dir, {"compression": RKV}, model_path=path)
    assert message in str(err.value) and str(err.value).startswith(f"model {path}: ") and "\n" not in str(err.value)


def _runner_with(**facts):
    """The plugin rig's model runner with some of its facts replaced (what a loaded model would show)."""
    from plugin_rig import RunnerAttributes

    runner = RunnerAttributes(rows=4, context=64, pool_tokens=128)
    for name, value in facts.items():
        setattr(runner, name, value)
    return runner


def _swa_pool():
    import torch
    from plugin_rig import HEAD_DIM, KV_HEADS
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=128, size_swa=64, page_size=1, dtype=torch.float32, head_num=KV_HEADS, head_dim=HEAD_DIM,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu",
                     enable_memory_saver=False)


def _layers(**kwargs):
    import torch
    from plugin_rig import HEAD_DIM, KV_HEADS, Q_HEADS
    from sglang.srt.layers.radix_attention import RadixAttention

    return torch.nn.ModuleList([RadixAttention(Q_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, layer_id=0),
                                RadixAttention(Q_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, layer_id=1, **kwargs)])


@pytest.mark.parametrize("facts,message", [
    (lambda: {"token_to_kv_pool": _swa_pool()}, "token_to_kv_pool=SWAKVPool: a KV pool other than SGLang's"),
    (lambda: {"sliding_window_size": 4095}, "sliding_window_size=4095: sliding-window attention"),
    (lambda: {"model": _layers(sliding_window_size=511)}, "sliding_window_size=511: sliding-window attention"),
    (lambda: {"model": _layers(is_cross_attention=True)}, "is_cross_attention=layer 1: cross-attention"),
])
def test_what_only_the_loaded_model_shows_is_refused_when_the_backend_is_built(facts, message):
    """Model load (the scheduler builds the backend, before the server serves): a window set by the model's code, a
    pool SGLang picked. Before issue 41 the backend was built on any of them (an SWAKVPool passed its attribute
    check) and the layers were refused at their first forward, taking the serving scheduler down."""
    from plugin_rig import published_parallel

    from sglang_ext.backend import SparseKVBackend
    from sglang_ext.config import SparseKVConfig

    with pytest.raises(ConfigError) as err, published_parallel():
        SparseKVBackend(_runner_with(**facts()), SparseKVConfig()).close()
    assert str(err.value).startswith("sparse_kv at model load: ") and message in str(err.value), str(err.value)


def _pool_of(cls_name: str, dtype, head_dim: int = 16):
    import torch
    from plugin_rig import KV_HEADS, LAYERS
    from sglang.srt.mem_cache import memory_pool

    return getattr(memory_pool, cls_name)(128, page_size=1, dtype=getattr(torch, dtype), head_num=KV_HEADS,
                                          head_dim=head_dim, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                          enable_alt_stream=False)


def test_a_kv_cache_quantised_by_the_checkpoint_is_refused_at_model_load():
    """``--kv-cache-dtype auto`` (what the argument check sees) becomes FP8 when the checkpoint's quantization config
    says so, in SGLang's plain MHATokenToKVPool: before issue 51 the backend was built on it (scorers reading the
    stored FP8 bytes unscaled). Refused from the resolved dtype, SGLang's own resolution giving it."""
    from types import SimpleNamespace

    import torch
    from plugin_rig import published_parallel
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype

    from sglang_ext.backend import SparseKVBackend
    from sglang_ext.config import SparseKVConfig

    model = torch.nn.Module()
    model.quant_config = SimpleNamespace(kv_cache_quant_algo="FP8")    # an FP8 checkpoint's (ModelOpt, compressed)
    _, kv_dtype = configure_kv_cache_dtype(server_args_kv_cache_dtype="auto", model=model, model_dtype=torch.float32,
                                           is_draft_worker=False, is_dflash=False,
                                           speculative_draft_attention_backend=None)
    assert kv_dtype == torch.float8_e4m3fn
    pool = _pool_of("MHATokenToKVPool", "float8_e4m3fn")
    with pytest.raises(ConfigError) as err, published_parallel():
        SparseKVBackend(_runner_with(token_to_kv_pool=pool, model=model), SparseKVConfig()).close()
    assert str(err.value) == (
        "sparse_kv at model load: kv_cache_dtype resolved to float8_e4m3fn (model dtype float32, from the checkpoint's "
        "quantization config: kv_cache_quant_algo=FP8): sparse_kv needs the KV cache in the model's dtype (its scorers "
        "and compaction read and write the stored keys and values as they are, without their quantization scales); "
        "serve a checkpoint without KV-cache quantization (no kv_cache_quant_algo in its quantization config) with "
        "--kv-cache-dtype auto")


@pytest.mark.parametrize("pool", [lambda: _pool_of("MHATokenToKVPoolFP4", "float4_e2m1fn_x2"),
                                  lambda: _pool_of("MHATokenToKVPoolMXFP8", "float8_e4m3fn", head_dim=32),
                                  lambda: _pool_of("NoOpMHATokenToKVPool", "float32")],
                         ids=["FP4", "MXFP8", "no-op"])
def test_pool_subclasses_are_refused_by_their_class(pool):
    """An ``isinstance(pool, MHATokenToKVPool)`` check let its subclasses through (the FP4 and MXFP8 pools: packed
    data and scale buffers): the pool must be exactly SGLang's plain one."""
    from plugin_rig import published_parallel

    from sglang_ext.backend import SparseKVBackend
    from sglang_ext.config import SparseKVConfig

    try:
        kv_pool = pool()
    except Exception as err:  # noqa: BLE001 - a pool SGLang cannot build on CPU: nothing to refuse here
        pytest.skip(f"SGLang builds no such pool on CPU: {err}")
    with pytest.raises(ConfigError) as err, published_parallel():
        SparseKVBackend(_runner_with(token_to_kv_pool=kv_pool), SparseKVConfig()).close()
    assert str(err.value).startswith(f"sparse_kv at model load: token_to_kv_pool={type(kv_pool).__name__}: a KV pool "
                                     "other than SGLang's per-head MHATokenToKVPool itself"), str(err.value)


def test_a_plain_sglang_server_on_cpu_gets_the_cpu_row_default(tiny_model_dir):
    """``sglang.Engine(...)`` and ``python -m sglang.launch_server`` with the plugin on CPU (not only the project's
    engine and launcher): ``max_running_requests`` = ``CPU_DEFAULT_RUNNING_REQUESTS`` unless given (before issue 41
    SGLang's request pool got 4097 rows, and the plugin its per-row memory for each)."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    from sglang_ext.config import CONFIG_ENV
    from sglang_ext.cpu_compat import CPU_DEFAULT_RUNNING_REQUESTS

    engine_args = resolved_server_args(tiny_model_dir, {"compression": RKV})
    assert resolved_view(engine_args).max_running_requests == CPU_DEFAULT_RUNNING_REQUESTS
    given = resolved_server_args(tiny_model_dir, {"compression": RKV}, max_running_requests=8)
    assert resolved_view(given).max_running_requests == 8
    other = resolved_server_args(tiny_model_dir, None, attention_backend="torch_native")
    assert resolved_view(other).max_running_requests is None   # not the plugin's: SGLang's own default
    with scheduler_env(**{CONFIG_ENV: json.dumps({"compression": RKV})}):   # SGLang's own launcher's command line
        cli = prepare_server_args(["--model-path", str(tiny_model_dir), "--attention-backend", "sparse_kv",
                                   "--device", "cpu", "--page-size", "1", "--sampling-backend", "pytorch"])
        cli.resolve_once()
    assert resolved_view(cli).max_running_requests == CPU_DEFAULT_RUNNING_REQUESTS


README = Path(__file__).resolve().parents[2] / "sglang_ext" / "README.md"
README_LIST = re.compile(r"<!-- refusals: (?P<stage>[a-z ]+) -->\n(?P<body>.*?)<!-- /refusals -->", re.S)


def test_the_readme_lists_what_the_code_refuses():
    """``sglang_ext/README.md``'s two lists of refused settings (one bullet per name, the name first) hold exactly
    the names of ``refusals``' tables, per stage."""
    from sglang_ext.refusals import refusals

    listed = {m["stage"]: re.findall(r"^- `([a-z0-9_]+)`", m["body"], re.M)
              for m in README_LIST.finditer(README.read_text())}
    for stage, names in listed.items():
        assert len(names) == len(set(names)), f"{stage}: listed twice: {sorted(n for n in names if names.count(n) > 1)}"
    code = refusals()
    assert set(listed) == set(code)
    for stage in code:
        assert set(listed[stage]) == code[stage], (f"{stage}: in the README only: {set(listed[stage]) - code[stage]}; "
                                                   f"in the code only: {code[stage] - set(listed[stage])}")
