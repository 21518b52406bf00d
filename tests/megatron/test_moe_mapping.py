"""Qwen3-MoE / Qwen2-MoE: HF config -> ModelArch, the expert weight map (router, per-expert gate/up/down, the shared
expert and its gate) at any TP x expert TP x EP, the export plan's expert owners, the megatron-core MoE fields, and
the refusals. In-process, torch + transformers (+ megatron-core's TransformerConfig); the model-level parity at
every layout is in test_moe_parity.py."""
import pytest
import torch

from sparse_rl_megatron.models import weight_map as wm
from sparse_rl_megatron.models.arch import ModelArch, MoEArch, arch_from_hf_config
from sparse_rl_megatron.models.catalog import bundled_config
from weight_names import hf_tensor_names

QWEN15_MOE = {  # the fields of Qwen/Qwen1.5-MoE-A2.7B's config.json that ModelArch reads (model_type qwen2_moe)
    "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 8192,
    "hidden_act": "silu", "use_sliding_window": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16",
}


def test_qwen3_30b_a3b_config():
    a = arch_from_hf_config(bundled_config("qwen3-30b-a3b"))
    assert (a.family, a.qk_norm, a.qkv_bias, a.head_dim, a.num_layers) == ("qwen3_moe", True, False, 128, 48)
    assert a.moe == MoEArch(num_experts=128, top_k=8, ffn_hidden_size=768, norm_topk_prob=True)
    assert a.expert_parallel_sizes() == [1, 2, 4, 8, 16, 32, 64, 128]
    # transformers >= 5 writes the expert count of a Qwen3-MoE config as num_local_experts
    cfg = dict(bundled_config("qwen3-30b-a3b"))
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert arch_from_hf_config(cfg) == a
    # survives the checkpoint metadata round trip (ModelArch.to_dict -> JSON -> from_dict)
    assert ModelArch.from_dict(a.to_dict()) == a


def test_qwen15_moe_config_has_a_gated_shared_expert():
    a = arch_from_hf_config(QWEN15_MOE)
    assert (a.family, a.qkv_bias, a.qk_norm) == ("qwen2_moe", True, False)
    assert a.moe == MoEArch(num_experts=60, top_k=4, ffn_hidden_size=1408, norm_topk_prob=False,
                            shared_expert_ffn_hidden_size=5632)
    # TP divides the heads, KV groups and the shared expert (not the unused dense intermediate_size)
    assert a.tensor_parallel_sizes() == [1, 2, 4, 8, 16]
    assert "moe" in " ".join(a.differences(arch_from_hf_config(dict(QWEN15_MOE, num_experts_per_tok=2))))


@pytest.mark.parametrize("cfg,message", [
    (dict(QWEN15_MOE, decoder_sparse_step=2), r"decoder_sparse_step=2 is not supported for qwen2_moe.*valid: 1"),
    (dict(QWEN15_MOE, mlp_only_layers=[0]), r"mlp_only_layers=\[0\] is not supported for qwen2_moe.*valid: \[\]"),
    ({k: v for k, v in QWEN15_MOE.items() if k != "num_experts"}, "names no num_experts"),
    (dict(QWEN15_MOE, num_experts_per_tok=61), r"top_k=61 \(num_experts_per_tok\) exceeds num_experts=60"),
    (dict(bundled_config("qwen3-30b-a3b"), attention_bias=True), "attention_bias=True is not supported for qwen3_moe"),
    (dict(QWEN15_MOE, model_type="qwen3_next"), r"unknown model family.*'qwen3_next'.*qwen2_moe, qwen3, qwen3_moe"),
])
def test_refusals(cfg, message):
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(cfg)


def test_expert_layout_checks_name_the_field_and_valid_values():
    a = arch_from_hf_config(QWEN15_MOE)
    with pytest.raises(ValueError, match=r"expert_parallel_size=8 does not divide num_experts=60 of this qwen2_moe "
                                         r"model; valid expert_parallel_size values: \[1, 2, 3, 4, 5, 6, 10, 12, 15, "
                                         r"20, 30, 60\]"):
        a.check_expert_parallel(8, 1)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size=3 does not divide moe_ffn_hidden_size"):
        a.check_expert_parallel(4, 3)
    a.check_expert_parallel(4, 2)
    dense = arch_from_hf_config(dict(bundled_config("qwen3-30b-a3b"), model_type="qwen3"))
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs a mixture-of-experts model"):
        dense.check_expert_parallel(2, 1)


def small(shared: bool, **kw) -> ModelArch:
    moe = MoEArch(num_experts=4, top_k=2, ffn_hidden_size=6, norm_topk_prob=not shared,
                  shared_expert_ffn_hidden_size=10 if shared else 0)
    base = dict(family="qwen2_moe" if shared else "qwen3_moe", vocab_size=250, hidden_size=16, num_layers=2,
                num_attention_heads=8, num_query_groups=4, head_dim=2, ffn_hidden_size=12, rope_theta=1e6,
                norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=shared, max_position_embeddings=64,
                qk_norm=not shared, moe=moe)
    return ModelArch(**{**base, **kw})


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_names_and_shapes_are_the_ones_transformers_saves(family, tmp_path):
    """The tiny HF models of ``models/tiny.py`` saved by transformers hold exactly the tensors of the weight map."""
    from safetensors import safe_open

    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

    save_tiny_hf_checkpoint(tmp_path, family, vocab_size=256, num_experts=4, moe_intermediate_size=16)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    import json

    a = arch_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert shapes == wm.expected_hf_shapes(a)
    assert sorted(hf_tensor_names(a)) == sorted(shapes)
    assert a.moe.has_shared_expert is (family == "qwen2_moe")


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tp,etp", [(1, 1), (2, 1), (2, 2), (1, 3)])
def test_random_round_trip_bit_identical(shared, tp, etp):
    a = small(shared)
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in wm.expected_hf_shapes(a).items()}
    back = {}
    for name in wm.mcore_param_names(a):
        kind = wm.param_kind(name)
        size = etp if kind in wm.EXPERT_KINDS else tp
        shards = [wm.hf_to_mcore(a, name, hf.__getitem__, tp_rank=r, tp_size=size, padded_vocab=a.padded_vocab_size(tp))
                  for r in range(size)]
        back.update(wm.mcore_to_hf(a, name, shards))
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_expert_shards_by_hand():
    """Expert 3 of layer 1: fc1 = [gate; up] split per expert-TP rank like the dense MLP, fc2 split by columns; the
    router and the shared expert's gate are whole on every rank."""
    a = small(shared=True)
    col = lambda *xs: torch.tensor([[float(x)] * 16 for x in xs])  # noqa: E731
    hf = {"model.layers.1.mlp.experts.3.gate_proj.weight": col(1, 2, 3, 4, 5, 6),
          "model.layers.1.mlp.experts.3.up_proj.weight": col(7, 8, 9, 10, 11, 12)}
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert wm.hf_names(a, name) == tuple(hf)
    shards = [wm.hf_to_mcore(a, name, hf.__getitem__, tp_rank=r, tp_size=2)[:, 0].tolist() for r in range(2)]
    assert shards == [[1, 2, 3, 7, 8, 9], [4, 5, 6, 10, 11, 12]]
    assert wm.param_kind("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight") == "expert_row"
    assert wm.hf_names(a, "decoder.layers.0.mlp.router.weight") == ("model.layers.0.mlp.gate.weight",)
    assert wm.hf_names(a, "decoder.layers.0.mlp.shared_experts.gate_weight") == ("model.layers.0.mlp.shared_expert_gate.weight",)
    for n in ("decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.shared_experts.gate_weight"):
        assert wm.param_kind(n) == "replicated"
    assert not any("mlp.linear_fc" in n for n in wm.mcore_param_names(a))  # no dense MLP in a MoE layer
    assert not any("shared" in n for n in wm.mcore_param_names(small(shared=False)))


def test_canonical_names_of_local_and_grouped_experts():
    # EP rank 1 of 2 with 4 experts holds experts 2 and 3 as its local 0 and 1
    assert wm.canonical_name("module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", lambda i: i + 2,
                             expert_offset=2) == "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"
    # Transformer Engine's grouped GEMM (TEGroupedMLP) names its experts weight<k>
    assert wm.canonical_name("decoder.layers.1.mlp.experts.linear_fc1.weight1", expert_offset=2) == \
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert wm.expert_index("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight") == 3
    assert wm.expert_index("decoder.layers.1.mlp.router.weight") is None
    with pytest.raises(KeyError, match="no HF mapping"):
        wm.param_kind("decoder.layers.0.mlp.experts.local_experts.0.linear_fc3.weight")


def test_export_plan_finds_every_experts_owner():
    """Each stage lists only the experts its own EP rank holds (here EP rank 0 of 2: experts 0 and 1); the plan still
    names every expert, on the stage of its layer's router, with the EP rank that holds it."""
    from sparse_rl_megatron.learner.weight_export import _plan

    a = small(shared=True)
    names = wm.mcore_param_names(a)
    seen = [n for n in names if wm.expert_index(n) is None or wm.expert_index(n) < 2]
    stage0 = [n for n in seen if n == wm.EMBEDDING or n.startswith("decoder.layers.0.")]
    stage1 = [n for n in seen if n not in stage0]
    items = _plan(a, [stage0, stage1], ep=2)
    assert [h for it in items for h, _ in it.hf] == hf_tensor_names(a)
    owners = {it.name: (it.owner_stage, it.owner_ep) for it in items}
    assert owners["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] == (1, 1)
    assert owners["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"] == (0, 0)
    assert owners["decoder.layers.0.mlp.router.weight"] == (0, None)


@pytest.mark.parametrize("shared", [False, True])
def test_megatron_moe_fields(shared):
    from sparse_rl_megatron.models.megatron_config import transformer_config

    a = small(shared)
    cfg = transformer_config(a, moe=dict(expert_parallel_size=2, expert_tensor_parallel_size=1, aux_loss_coeff=0.01,
                                         router_dtype="fp32"), cuda=False)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 6)
    # renormalised top-k (Qwen3-MoE) = softmax over the selected logits; Qwen2-MoE: top-k of the full softmax
    assert cfg.moe_router_pre_softmax is shared and cfg.moe_router_score_function == "softmax"
    assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (2, 1)
    assert cfg.moe_aux_loss_coeff == 0.01 and cfg.moe_router_dtype == "fp32"
    assert cfg.moe_token_dispatcher_type == "alltoall" and cfg.moe_expert_capacity_factor is None
    assert cfg.moe_shared_expert_gate is shared
    assert cfg.moe_shared_expert_intermediate_size == (10 if shared else None)
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide num_experts=4"):
        transformer_config(a, moe=dict(expert_parallel_size=3), cuda=False)
