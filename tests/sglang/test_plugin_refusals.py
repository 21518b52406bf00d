"""Settings the plugin cannot serve are refused when the server starts, in one line naming the flag; every method
the AttentionBackend base class leaves raising is implemented by the plugin or belongs to a refused feature."""
from __future__ import annotations

import inspect

import pytest
from sglang_helpers import resolved_server_args

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
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_refused_at_start_in_one_line_naming_the_flag(tiny_model_dir, feature):
    overrides, message = FEATURES[feature]
    with pytest.raises(ConfigError) as err:
        resolved_server_args(tiny_model_dir, {"compression": RKV}, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


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


def test_good_settings_pass(tiny_model_dir):
    resolved_server_args(tiny_model_dir, {"compression": RKV, "kept_digest": True})
    # plain DP: a scheduler (and a backend) per replica
    resolved_server_args(tiny_model_dir, {"compression": RKV}, dp_size=2)


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
