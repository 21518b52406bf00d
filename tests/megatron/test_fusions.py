"""Which megatron-core fusions the learner turns on (``models.megatron_config.fusion_settings``): all off on CPU;
on CUDA what megatron-core 0.16.1 can run for RMSNorm / SwiGLU / RoPE models, by its own availability flags.
In-process: CUDA is only *reported* here (``torch.cuda.is_available``), the TransformerConfig is built and
validated by megatron-core, nothing runs a kernel."""
import importlib.util

import pytest
import torch

from sparse_rl_megatron.models.arch import arch_from_hf_config
from sparse_rl_megatron.models.megatron_config import FUSION_SWITCHES, fusion_settings, transformer_config

from test_arch_and_config import QWEN25_7B


def test_cpu_turns_every_fusion_off():
    assert fusion_settings(False) == {**{k: False for k in FUSION_SWITCHES}, "use_cpu_initialization": True}


@pytest.mark.parametrize("extensions", [False, True])
def test_cuda_turns_on_what_megatron_can_run(monkeypatch, extensions):
    """Without TE / apex (this machine): fused SwiGLU and bias-dropout-add; with TE's fused RoPE and apex's
    kernels present (megatron's flags set as its imports would): those too. persist_layer_norm stays off."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", (lambda *a: None) if extensions else None)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", extensions)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        real_find_spec("torch") if extensions and name.endswith("softmax_cuda") else real_find_spec(name, *a)))
    cfg = transformer_config(arch_from_hf_config(QWEN25_7B), tensor_parallel_size=4, params_dtype=torch.bfloat16)
    want = dict(bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=extensions,
                gradient_accumulation_fusion=extensions, masked_softmax_fusion=extensions, persist_layer_norm=False)
    assert {k: getattr(cfg, k) for k in want} == want
    assert not cfg.use_cpu_initialization
    cfg = transformer_config(arch_from_hf_config(QWEN25_7B), overrides={"bias_activation_fusion": False})
    assert cfg.bias_activation_fusion is False  # an override still wins


def test_config_build_raises_no_deprecation_warning():
    """megatron-core 0.16's default cuda_graph_scope ('full') warns on every build; the learner passes the
    current spelling of the same scope, so a build is silent (on GPU too, where no filter applies)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = transformer_config(arch_from_hf_config(QWEN25_7B))
    assert [str(w.message) for w in caught] == [] and cfg.cuda_graph_scope == []
