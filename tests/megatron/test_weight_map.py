"""HF <-> Megatron weight layout, by hand-worked examples and random round trips (torch only, in-process)."""
import pytest
import torch

from sparse_rl_megatron.models import weight_map as wm
from sparse_rl_megatron.models.arch import ModelArch
from weight_names import hf_tensor_names


def arch(**kw) -> ModelArch:
    base = dict(family="qwen2", vocab_size=5, hidden_size=1, num_layers=2, num_attention_heads=4, num_query_groups=2,
                head_dim=1, ffn_hidden_size=4, rope_theta=1e4, norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True,
                max_position_embeddings=64)
    base.update(kw)
    return ModelArch(**base)


def col(*xs):
    return torch.tensor([[float(x)] for x in xs])


def test_qkv_grouped_by_query_group_and_split_by_group():
    a = arch()
    hf = {"model.layers.0.self_attn.q_proj.weight": col(1, 2, 3, 4), "model.layers.0.self_attn.k_proj.weight": col(10, 20),
          "model.layers.0.self_attn.v_proj.weight": col(100, 200)}
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    full = wm.hf_to_mcore(a, name, hf.__getitem__)
    assert full.flatten().tolist() == [1, 2, 10, 100, 3, 4, 20, 200]  # [q heads of g0, k0, v0, q of g1, k1, v1]
    r0 = wm.hf_to_mcore(a, name, hf.__getitem__, tp_rank=0, tp_size=2)
    r1 = wm.hf_to_mcore(a, name, hf.__getitem__, tp_rank=1, tp_size=2)
    assert r0.flatten().tolist() == [1, 2, 10, 100] and r1.flatten().tolist() == [3, 4, 20, 200]
    back = wm.mcore_to_hf(a, name, [r0, r1])
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_gate_up_split_per_tp_rank():
    a = arch()
    hf = {"model.layers.1.mlp.gate_proj.weight": col(1, 2, 3, 4), "model.layers.1.mlp.up_proj.weight": col(5, 6, 7, 8)}
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    assert wm.hf_to_mcore(a, name, hf.__getitem__).flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    shards = [wm.hf_to_mcore(a, name, hf.__getitem__, tp_rank=r, tp_size=2) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[1, 2, 5, 6], [3, 4, 7, 8]]  # [gate_r; up_r] on rank r
    back = wm.mcore_to_hf(a, name, shards)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_vocab_padding_is_zero_and_stripped():
    a = arch()
    emb = col(1, 2, 3, 4, 5)
    shards = [wm.hf_to_mcore(a, wm.EMBEDDING, {wm.HF_EMBED: emb}.__getitem__, tp_rank=r, tp_size=2, padded_vocab=8)
              for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[1, 2, 3, 4], [5, 0, 0, 0]]
    assert torch.equal(wm.mcore_to_hf(a, wm.EMBEDDING, shards)[wm.HF_EMBED], emb)


def test_row_parallel_splits_input_dim():
    a = arch(hidden_size=2, ffn_hidden_size=4)
    down = torch.arange(8.0).reshape(2, 4)
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    shards = [wm.hf_to_mcore(a, name, {"model.layers.0.mlp.down_proj.weight": down}.__getitem__, tp_rank=r, tp_size=2)
              for r in range(2)]
    assert shards[0].tolist() == [[0, 1], [4, 5]] and shards[1].tolist() == [[2, 3], [6, 7]]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied,bias,qk_norm", [(True, True, False), (False, False, False),  # qwen2, llama
                                               (True, False, True), (False, False, True)])  # qwen3
def test_random_round_trip_bit_identical(tp, tied, bias, qk_norm):
    a = arch(vocab_size=250, hidden_size=16, num_attention_heads=8, num_query_groups=4, head_dim=2, ffn_hidden_size=12,
             tie_word_embeddings=tied, qkv_bias=bias, qk_norm=qk_norm)
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in wm.expected_hf_shapes(a).items()}
    back = {}
    for name in wm.mcore_param_names(a):
        shards = [wm.hf_to_mcore(a, name, hf.__getitem__, tp_rank=r, tp_size=tp, padded_vocab=a.padded_vocab_size(tp))
                  for r in range(tp)]
        back.update(wm.mcore_to_hf(a, name, shards))
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    assert ("lm_head.weight" in hf_tensor_names(a)) is (not tied)


def test_canonical_names_fold_te_aliases_and_layer_offsets():
    assert wm.canonical_name("module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", lambda i: i + 3) \
        == "decoder.layers.3.input_layernorm.weight"
    assert wm.canonical_name("decoder.layers.1.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.1.pre_mlp_layernorm.weight"
    assert wm.canonical_name("output_layer.weight") == "output_layer.weight"
    with pytest.raises(KeyError, match="no HF mapping"):
        wm.param_kind("decoder.layers.0.mlp.unknown.weight")


def test_padded_vocab_is_layout_independent():
    qwen = arch(vocab_size=151936)
    assert {qwen.padded_vocab_size(tp) for tp in (1, 2, 4, 8)} == {151936}
    assert arch(vocab_size=250).padded_vocab_size(2) == 256
    assert arch(vocab_size=250).padded_vocab_size(3) == 384  # lcm(128, 3)


def test_hf_checkpoint_missing_lm_head_is_refused():
    """The slime #345 failure: an untied model whose checkpoint lacks lm_head must not load silently."""
    a = arch(tie_word_embeddings=False)
    shapes = wm.expected_hf_shapes(a)
    del shapes["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \['lm_head.weight'\]"):
        wm.check_hf_tensors(a, shapes)
    shapes = wm.expected_hf_shapes(a)
    shapes["model.layers.1.mlp.up_proj.weight"] = (5, 1)
    with pytest.raises(ValueError, match=r"up_proj.weight: checkpoint shape \(5, 1\) vs expected \(4, 1\)"):
        wm.check_hf_tensors(a, shapes)


def test_hf_checkpoint_with_unexpected_tensors_is_refused():
    """A tensor the map does not know (a bias of a bias-free layer, an extra layer) was dropped silently on
    conversion before issue 51: now refused by name (a few, then a count)."""
    a = arch(qkv_bias=False)
    shapes = wm.expected_hf_shapes(a)
    shapes["model.layers.0.self_attn.q_proj.bias"] = (4,)
    with pytest.raises(ValueError) as err:
        wm.check_hf_tensors(a, shapes)
    assert "unexpected tensors ['model.layers.0.self_attn.q_proj.bias']" in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    shapes = wm.expected_hf_shapes(a)
    extra = {f"model.layers.{i}.mlp.up_proj.bias": (4,) for i in range(2, 12)}   # layers the config does not have
    with pytest.raises(ValueError, match=r"unexpected tensors \[.*\] and 4 more \(10 in all\)"):
        wm.check_hf_tensors(a, {**shapes, **extra})


def test_hf_tensors_legitimately_ignored_are_accepted():
    """What real checkpoints carry beside the weights: RoPE ``inv_freq`` buffers (older transformers saved them),
    a tied model's ``lm_head.weight`` (the LM head is the embedding, as transformers ties it on load)."""
    tied = arch(tie_word_embeddings=True)
    shapes = {**wm.expected_hf_shapes(tied), "lm_head.weight": (5, 1),
              "model.layers.0.self_attn.rotary_emb.inv_freq": (1,), "model.layers.1.self_attn.rotary_emb.inv_freq": (1,)}
    wm.check_hf_tensors(tied, shapes)
    untied = arch(tie_word_embeddings=False)
    wm.check_hf_tensors(untied, {**wm.expected_hf_shapes(untied), "model.layers.1.self_attn.rotary_emb.inv_freq": (1,)})


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen2", False), ("llama", True), ("qwen3", False),
                                         ("qwen3_moe", False), ("qwen2_moe", False)])
def test_checkpoints_transformers_saves_pass_the_check(tmp_path, family, tied):
    """What ``save_pretrained`` writes (the tiny models, the GGUF import's output) holds only expected tensors."""
    from sparse_rl_megatron.learner.hf_io import SafetensorsReader, read_arch
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

    path = save_tiny_hf_checkpoint(tmp_path / family, family, tie_word_embeddings=tied)
    checkpoint_arch, _ = read_arch(path)
    wm.check_hf_tensors(checkpoint_arch, SafetensorsReader(path).shapes())


def test_export_buckets_respect_size_and_stage_boundaries():
    """Buckets follow the HF order, never mix pipeline stages, and stay under the byte budget unless a single
    tensor is larger; a tied model exports the embedding once and no lm_head."""
    from sparse_rl_megatron.learner.weight_export import _buckets, _plan

    a = arch(vocab_size=250, hidden_size=16, num_layers=4, num_attention_heads=8, num_query_groups=4, head_dim=2,
             ffn_hidden_size=12, tie_word_embeddings=True)
    names = wm.mcore_param_names(a)
    stage0 = [n for n in names if n == wm.EMBEDDING or n.startswith(("decoder.layers.0.", "decoder.layers.1."))]
    stage1 = [n for n in names if n not in stage0]
    items = _plan(a, [stage0, stage1])
    assert [h for it in items for h, _ in it.hf] == hf_tensor_names(a)
    assert "lm_head.weight" not in hf_tensor_names(a)
    budget = 3000
    buckets = _buckets(items, budget, itemsize=4)
    for b in buckets:
        assert len({it.owner_stage for it in b}) == 1
        assert len(b) == 1 or sum(it.numel for it in b) * 4 <= budget
    assert [it for b in buckets for it in b] == items
    assert buckets[0][0].name == wm.EMBEDDING and len(buckets[0]) == 1  # 250 x 16 x 4 B > budget: alone
