"""Qwen3 dense and Llama 3.x RoPE scaling: HF config -> ModelArch, weight map, RoPE frequencies vs transformers,
and the refusals (other model types, other RoPE types). In-process, torch + transformers + megatron-core modules only
(no process group); the model-level parity at every layout is in test_parity_and_logprobs.py."""
import math

import pytest
import torch

from sparse_rl_megatron.models import weight_map as wm
from sparse_rl_megatron.models.arch import ModelArch, RopeScaling, arch_from_hf_config

QWEN3_8B = {  # the fields of Qwen3-8B's config.json that ModelArch reads
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
}
LLAMA31_8B = {  # Llama-3.1-8B: rope_scaling in the pre-transformers-5 layout
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 131072, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def test_qwen3_config():
    a = arch_from_hf_config(QWEN3_8B)
    assert (a.family, a.qk_norm, a.qkv_bias, a.head_dim, a.num_query_groups) == ("qwen3", True, False, 128, 8)
    assert a.rope_scaling is None and a.rope_theta == 1e6
    # head_dim is read, not derived: Qwen3-32B has 64 heads x 128 = 8192 != hidden 5120
    assert arch_from_hf_config(dict(QWEN3_8B, hidden_size=5120, num_attention_heads=64)).head_dim == 128


def test_llama3_rope_scaling_both_config_layouts():
    want = RopeScaling(8.0, 1.0, 4.0, 8192)
    assert arch_from_hf_config(LLAMA31_8B).rope_scaling == want
    t5 = dict(LLAMA31_8B, rope_parameters=dict(LLAMA31_8B["rope_scaling"], rope_theta=5e5))  # transformers >= 5
    del t5["rope_scaling"], t5["rope_theta"]
    a = arch_from_hf_config(t5)
    assert a.rope_scaling == want and a.rope_theta == 5e5
    # original_max_position_embeddings falls back to max_position_embeddings, as in transformers
    no_orig = dict(LLAMA31_8B, rope_scaling={k: v for k, v in LLAMA31_8B["rope_scaling"].items()
                                             if k != "original_max_position_embeddings"})
    assert arch_from_hf_config(no_orig).rope_scaling.original_max_position_embeddings == 131072
    # survives the checkpoint metadata round trip (ModelArch.to_dict -> JSON -> from_dict)
    assert ModelArch.from_dict(a.to_dict()) == a and ModelArch.from_dict(a.to_dict()).differences(a) == []
    assert "rope_scaling" in " ".join(a.differences(arch_from_hf_config(dict(t5, rope_parameters={"rope_theta": 5e5}))))


@pytest.mark.parametrize("cfg,message", [
    (dict(QWEN3_8B, model_type="qwen3_next"),
     r"unknown model family \(HF model_type\) 'qwen3_next'; valid names: llama, qwen2, qwen2_moe, qwen3, qwen3_moe"),
    (dict(QWEN3_8B, attention_bias=True), "attention_bias=True is not supported for qwen3"),
    (dict(QWEN3_8B, use_sliding_window=True), "use_sliding_window=True is not supported for qwen3"),
    (dict(QWEN3_8B, layer_types=["full_attention", "sliding_attention"]),
     r"layer_types \['sliding_attention'\] are not supported for qwen3; valid: full_attention"),
    (dict(LLAMA31_8B, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_type='yarn' is not supported; valid: default, llama3"),
    (dict(LLAMA31_8B, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     r"rope_type='llama3' needs rope_scaling/rope_parameters fields \['low_freq_factor', 'high_freq_factor'\]"),
    (dict(LLAMA31_8B, rope_scaling=dict(LLAMA31_8B["rope_scaling"], high_freq_factor=1.0)),
     "0 < low_freq_factor < high_freq_factor"),
    (dict(QWEN3_8B, partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not supported; valid: 1.0"),
])
def test_refusals(cfg, message):
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(cfg)


def _small_qwen3(tied: bool) -> ModelArch:
    return ModelArch(family="qwen3", vocab_size=250, hidden_size=16, num_layers=2, num_attention_heads=8,
                     num_query_groups=4, head_dim=4, ffn_hidden_size=12, rope_theta=1e6, norm_eps=1e-6,
                     tie_word_embeddings=tied, qkv_bias=False, max_position_embeddings=64, qk_norm=True)


def test_qwen3_qk_norms_are_replicated_per_layer():
    a = _small_qwen3(tied=False)
    name = "decoder.layers.1.self_attention.k_layernorm.weight"
    assert name in wm.mcore_param_names(a) and wm.param_kind(name) == "replicated"
    assert wm.hf_names(a, name) == ("model.layers.1.self_attn.k_norm.weight",)
    assert wm.expected_hf_shapes(a)["model.layers.0.self_attn.q_norm.weight"] == (4,)
    k = torch.arange(4.0)
    shards = [wm.hf_to_mcore(a, name, {"model.layers.1.self_attn.k_norm.weight": k}.__getitem__, tp_rank=r, tp_size=2)
              for r in range(2)]
    assert all(torch.equal(s, k) for s in shards)
    assert not any("norm" in n and "self_attention" in n for n in wm.mcore_param_names(
        ModelArch(**{**a.to_dict(), "qk_norm": False, "rope_scaling": None})))


@pytest.mark.parametrize("scaling", [RopeScaling(8.0, 1.0, 4.0, 8192), RopeScaling(32.0, 1.0, 4.0, 8192),
                                     RopeScaling(8.0, 1.0, 4.0, 32), RopeScaling(4.0, 2.0, 3.0, 64)])
def test_megatron_llama3_frequencies_equal_transformers(scaling):
    """The learner's RoPE (megatron-core's RotaryEmbedding + models/rope.py) == transformers' llama3 inv_freq,
    bit for bit, for Llama 3.1 / 3.2 and non-default low/high factors (which megatron's own rope_scaling=True
    would ignore: it fixes them at 1 / 4 / 8192)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sparse_rl_megatron.models.rope import apply_rope_scaling

    head_dim, theta = 128, 5e5
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                                       "low_freq_factor": scaling.low_freq_factor,
                                       "high_freq_factor": scaling.high_freq_factor,
                                       "original_max_position_embeddings": scaling.original_max_position_embeddings})
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    assert attention_factor == 1.0

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary_pos_emb = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=theta,
                                                  use_cpu_initialization=True)

    plain, scaled = Stage(), Stage()
    arch = arch_from_hf_config(dict(LLAMA31_8B, rope_scaling=dict(LLAMA31_8B["rope_scaling"], **scaling.__dict__)))
    apply_rope_scaling(scaled, arch)
    assert torch.equal(scaled.rotary_pos_emb.inv_freq, hf_inv_freq)
    changed = (scaled.rotary_pos_emb.inv_freq != plain.rotary_pos_emb.inv_freq).sum().item()
    long_wave = (2 * math.pi / plain.rotary_pos_emb.inv_freq > scaling.original_max_position_embeddings
                 / scaling.high_freq_factor).sum().item()
    assert changed == long_wave > 0  # exactly the frequencies above the high-frequency threshold move
