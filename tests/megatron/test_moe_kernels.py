"""Which experts' kernels a mixture of experts gets for which device facts (``model_provider.resolve_expert_kernels``,
``megatron_config.moe_kernel_settings``): Transformer Engine's grouped GEMM (``TEGroupedMLP``) where the TE layer
spec runs (a GPU with TE), megatron-core's ``SequentialMLP`` otherwise. In-process: CUDA and TE are only *reported*
(``DeviceFacts``, megatron-core's ``HAVE_TE`` flags), the TransformerConfig is built and validated by megatron-core,
the TE spec builder is recorded instead of called (TE is not installed here); nothing runs a kernel. What the CPU
learner builds (``expert_mlp=SequentialMLP`` in ``Learner.describe()``) is checked in
``test_moe_parity.py::check_build``."""
import pytest

from sparse_rl_megatron.learner import model_provider as mp
from sparse_rl_megatron.models.megatron_config import moe_kernel_settings, transformer_config
from sparse_rl_megatron.utils.device import DeviceFacts

from test_moe_mapping import small

GPU = DeviceFacts(cuda=True, gpus=8)
CPU = DeviceFacts(cuda=False, gpus=0)
PERMUTE_KERNELS = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                   "fused_sort_chunks_by_index_with_probs", "fused_unpermute")


@pytest.fixture
def te_present(monkeypatch):
    """megatron-core's view of a GPU machine with Transformer Engine: HAVE_TE, its fused permutation kernels, and
    the TE layer spec builder (recorded: TE's modules cannot be imported here)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.moe import moe_utils

    calls = []
    local = gpt_layer_specs.get_gpt_layer_local_spec
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kw: calls.append(kw) or local(num_experts=kw["num_experts"],
                                                               qk_layernorm=kw["qk_layernorm"]))
    monkeypatch.setattr(moe_utils, "HAVE_TE", True)
    for name in PERMUTE_KERNELS:
        monkeypatch.setattr(moe_utils, name, lambda *a, **k: None, raising=False)  # absent without TE
    return calls


def test_gpu_with_te_defaults_to_grouped_gemm(te_present):
    spec = mp.resolve_layer_spec("auto", GPU)
    assert spec == "te" and mp.resolve_expert_kernels("auto", spec) == "grouped"
    cfg = transformer_config(small(False), moe=dict(grouped_gemm=True), cuda=True)
    assert (cfg.moe_grouped_gemm, cfg.moe_permute_fusion, cfg.moe_router_fusion) == (True, True, False)
    mp.layer_spec("auto", facts=GPU, num_experts=4, moe_grouped_gemm=cfg.moe_grouped_gemm)
    assert te_present[-1]["moe_grouped_gemm"] is True  # TE's spec then builds TEGroupedMLP
    assert mp.resolve_expert_kernels("sequential", spec) == "sequential"  # the fallback on a TE machine


def test_without_te_the_experts_run_one_after_the_other():
    """CPU, or a GPU without a usable TE: the local spec, SequentialMLP, no MoE fusion (this machine: TE absent)."""
    for facts in (CPU, GPU):
        spec = mp.resolve_layer_spec("auto", facts)
        assert spec == "local" and mp.resolve_expert_kernels("auto", spec) == "sequential"
    assert moe_kernel_settings(False) == dict(moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False)
    cfg = transformer_config(small(True), moe=dict(grouped_gemm=False), cuda=False)
    assert not (cfg.moe_grouped_gemm or cfg.moe_permute_fusion or cfg.moe_router_fusion)


def test_grouped_gemm_without_te_kernels_keeps_permutation_unfused(monkeypatch):
    """Grouped GEMM asked for where megatron-core found no fused permutation (TE < 2.1): permutation stays unfused
    (megatron-core would refuse the switch)."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(moe_utils, "HAVE_TE", True)
    monkeypatch.setattr(moe_utils, "fused_permute", None, raising=False)
    assert moe_kernel_settings(True) == dict(moe_grouped_gemm=True, moe_permute_fusion=False, moe_router_fusion=False)


def test_grouped_without_te_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^learner.moe.experts='grouped' needs the Transformer Engine layer spec .*"
                                         r"valid: auto, sequential$"):
        mp.resolve_expert_kernels("grouped", "local")
    with pytest.raises(ValueError, match=r"learner.moe.experts: .*'fused'.*auto, grouped, sequential"):
        mp.resolve_expert_kernels("fused", "te")
