"""Scorers on tiny tensors against hand-computed values (algorithm.md, "KV compression operators")."""
import math

import pytest
import torch

from sparse_rl_megatron.compression import (
    SCORERS, CompressionConfig, ScoreInputs, attention_mass, get_scorer, key_redundancy, window_importance,
)

LN3 = math.log(3.0)


def _k(*rows):
    """[1, 1, N, D] keys of one sequence and one KV head."""
    return torch.tensor(rows, dtype=torch.float32)[None, None]


def test_window_importance_softmax_over_keys_before_window():
    # alpha = 1 query [1, 0]; keys before the window give logits 0 and ln 3 (scaling 1) -> softmax 1/4, 3/4.
    keys = _k([0.0, 0.0], [LN3, 0.0], [5.0, 5.0])  # the last key is the window: not in the normalisation
    q = torch.tensor([[[[1.0, 0.0]]]])
    out = window_importance(q, keys, window=1, pool_kernel=1, scaling=1.0)
    torch.testing.assert_close(out, torch.tensor([[[0.25, 0.75]]]))


def test_window_importance_mean_over_window_then_max_pool():
    keys = _k([LN3, 0.0], [0.0, 0.0], [0.0, LN3], [9.0, 9.0], [9.0, 9.0])
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # two window queries
    # query 1 logits [ln3, 0, 0] -> [3/5, 1/5, 1/5]; query 2 logits [0, 0, ln3] -> [1/5, 1/5, 3/5]
    mean = torch.tensor([0.4, 0.2, 0.4])
    torch.testing.assert_close(window_importance(q, keys, window=2, pool_kernel=1, scaling=1.0), mean[None, None])
    # kernel 3, padding 1: [max(.4,.2), max(.4,.2,.4), max(.2,.4)]
    pooled = window_importance(q, keys, window=2, pool_kernel=3, scaling=1.0)
    torch.testing.assert_close(pooled, torch.tensor([[[0.4, 0.4, 0.4]]]))


def test_window_importance_default_scaling_is_inverse_sqrt_head_dim():
    # D = 2: q.k = sqrt(2) ln 3, scaled by 1/sqrt(2) -> logit ln 3 -> softmax [1/4, 3/4]
    keys = _k([0.0, 0.0], [math.sqrt(2) * LN3, 0.0], [1.0, 1.0])
    q = torch.tensor([[[[1.0, 0.0]]]])
    torch.testing.assert_close(window_importance(q, keys, window=1, pool_kernel=1), torch.tensor([[[0.25, 0.75]]]))


def test_gqa_pools_logits_of_a_group_before_softmax():
    # 2 query heads share 1 KV head. Head 0 logits [ln3, 0], head 1 logits [0, 0].
    keys = _k([LN3, 0.0], [0.0, 0.0], [0.0, 0.0])
    q = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # [1, Hq=2, alpha=1, D=2]
    out_max = window_importance(q, keys, window=1, pool_kernel=1, scaling=1.0)
    torch.testing.assert_close(out_max, torch.tensor([[[0.75, 0.25]]]))
    out_mean = window_importance(q, keys, window=1, pool_kernel=1, scaling=1.0, gqa_pooling="mean")
    w = math.sqrt(3.0)  # exp(ln3 / 2)
    torch.testing.assert_close(out_mean, torch.tensor([[[w / (w + 1), 1 / (w + 1)]]]))


def test_gqa_query_head_to_kv_head_mapping():
    # 2 KV heads, 4 query heads: query heads 0,1 -> KV head 0; 2,3 -> KV head 1 (HF repeat_kv layout).
    keys = torch.zeros(1, 2, 3, 2)
    keys[0, 0, 0] = torch.tensor([LN3, 0.0])
    keys[0, 1, 1] = torch.tensor([LN3, 0.0])
    q = torch.zeros(1, 4, 1, 2)
    q[0, 0, 0, 0] = 1.0  # only query head 0 (group of KV head 0) is active
    q[0, 2, 0, 0] = 1.0  # only query head 2 (group of KV head 1)
    out = window_importance(q, keys, window=1, pool_kernel=1, scaling=1.0)
    torch.testing.assert_close(out, torch.tensor([[[0.75, 0.25], [0.25, 0.75]]]))


def test_redundancy_two_duplicates_hand_values():
    keys = _k([1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [-1.0, 0.0])
    # cos: (0,2)=1, (0,3)=(2,3)=-1, others 0. Row 0 zeroes its newest duplicate 2, row 2 zeroes 0.
    # column means over 4 rows: [-1/4, 0, -1/4, -2/4]; then softmax.
    expected = torch.softmax(torch.tensor([-0.25, 0.0, -0.25, -0.5]), dim=0)
    torch.testing.assert_close(key_redundancy(keys), expected[None, None])


def test_redundancy_newest_of_three_duplicates_is_least_redundant():
    keys = _k([1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0])
    # rows 0 and 1 zero their entry for key 2 (newest duplicate); row 2 zeroes key 1 (its newest duplicate).
    expected = torch.softmax(torch.tensor([0.5, 0.25, 0.0, 0.0]), dim=0)
    out = key_redundancy(keys)
    torch.testing.assert_close(out, expected[None, None])
    assert out[0, 0, 2] < out[0, 0, 1] < out[0, 0, 0]


def test_redundancy_row_without_duplicates_zeroes_nothing():
    # The reference code zeroes column 0 in such rows; we do not (documented in redundancy.py).
    keys = _k([1.0, 0.0], [0.6, 0.8], [0.0, 1.0])
    sim = torch.tensor([[0.0, 0.6, 0.0], [0.6, 0.0, 0.8], [0.0, 0.8, 0.0]])
    # threshold 0.9: no pair is similar, nothing zeroed
    torch.testing.assert_close(key_redundancy(keys, threshold=0.9), sim.mean(0).softmax(0)[None, None])


def _cfg(method, **kw):
    base = dict(method=method, budget=3, window=1, buffer=1, pool_kernel=1)
    base.update(kw)
    return CompressionConfig(**base)


def test_rkv_combines_importance_and_redundancy():
    keys = _k([1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.3, 0.3])
    q = torch.tensor([[[[0.5, -0.2]]]])
    inputs = ScoreInputs(keys=keys, values=keys, queries=q, scaling=1.0)
    imp = window_importance(q, keys, window=1, pool_kernel=1, scaling=1.0)
    red = key_redundancy(keys)[..., :3]
    out = get_scorer("rkv")(inputs, _cfg("rkv", rkv_lambda=0.1))
    torch.testing.assert_close(out, 0.1 * imp - 0.9 * red)
    torch.testing.assert_close(get_scorer("snapkv")(inputs, _cfg("snapkv")), imp)


def test_streamingllm_sinks_then_recency():
    keys = torch.zeros(1, 2, 6, 4)
    out = get_scorer("streamingllm")(ScoreInputs(keys=keys, values=keys), _cfg("streamingllm", budget=4, sink_tokens=2))
    inf = float("inf")
    torch.testing.assert_close(out, torch.tensor([[inf, inf, 2.0, 3.0, 4.0]] * 2)[None])


def test_attention_mass_and_h2o():
    keys = _k([0.0, 0.0], [LN3, 0.0], [0.0, 0.0])
    q = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]])
    # causal prefill: query 0 sees key 0 only (1.0); query 1 sees keys 0,1 (1/4, 3/4)
    mass = attention_mass(q, keys[:, :, :2], causal_offset=0, scaling=1.0)
    torch.testing.assert_close(mass, torch.tensor([[[1.25, 0.75]]]))
    # a decode query with key slot 2 masked out (padding)
    mass = attention_mass(q[:, :, :1], keys, key_mask=torch.tensor([[True, True, False]]), scaling=1.0)
    torch.testing.assert_close(mass, torch.tensor([[[0.25, 0.75, 0.0]]]))
    acc = torch.tensor([[[5.0, 1.0, 2.0, 7.0]]])
    out = get_scorer("h2o")(ScoreInputs(keys=torch.zeros(1, 1, 4, 2), values=torch.zeros(1, 1, 4, 2),
                                        accumulated_attention=acc), _cfg("h2o"))
    torch.testing.assert_close(out, acc[..., :3])


def test_scorer_registry_and_requirements():
    assert set(SCORERS.names()) == {"none", "rkv", "snapkv", "streamingllm", "h2o", "triattention"}
    assert not get_scorer("none").compresses
    keys = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="needs ScoreInputs.queries"):
        get_scorer("rkv")(ScoreInputs(keys=keys, values=keys), _cfg("rkv"))
    with pytest.raises(ValueError, match="accumulated_attention"):
        get_scorer("h2o")(ScoreInputs(keys=keys, values=keys), _cfg("h2o"))
    with pytest.raises(KeyError, match="valid names: h2o, none, rkv, snapkv, streamingllm, triattention"):
        get_scorer("pyramidkv")
