"""Config validation, the schedule's triggers and capacity, and the kept-index digest format."""
import hashlib

import pytest
import torch

from sparse_rl_megatron.compression import CompressionConfig, CompressionSchedule, KeptDigest


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="rkv", budget=8, window=8), "budget must be > window"),
    (dict(method="rkv", budget=4, window=8), "budget must be > window"),
    (dict(method="quest"), "CompressionConfig.method: unknown KV compression method 'quest'; valid names: h2o, none"),
    (dict(method="rkv", window=0), "window must be >= 1"),
    (dict(method="rkv", buffer=0), "buffer must be >= 1"),
    (dict(method="rkv", scope="prompt"), "scope must be one of all, response"),
    (dict(method="rkv", pool_kernel=4), "pool_kernel must be odd"),
    (dict(method="rkv", rkv_lambda=1.5), "rkv_lambda must be in"),
    (dict(method="streamingllm", budget=10, window=8, sink_tokens=3), "sink_tokens must be in"),
    (dict(method="rkv", scope="response", compress_prefill=True), "compress_prefill needs scope='all'"),
    (dict(method="rkv", gqa_pooling="sum"), "gqa_pooling must be one of max, mean"),
    (dict(method="rkv", budget=12.5), "budget must be an int"),
])
def test_bad_config_is_refused_with_field_and_valid_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CompressionConfig(**kwargs)


def test_defaults_are_the_reference_settings():
    c = CompressionConfig(method="rkv")
    assert (c.budget, c.window, c.buffer, c.rkv_lambda, c.pool_kernel, c.scope) == (512, 8, 128, 0.1, 7, "all")
    assert not c.compress_prefill and c.max_candidates == 640
    assert CompressionConfig().is_dense


def test_schedule_triggers():
    s = CompressionSchedule(CompressionConfig(method="snapkv", budget=10, window=2, buffer=4))
    assert [s.after_decode(n) for n in (10, 13, 14, 20)] == [False, False, True, True]
    assert not s.after_prefill(100)  # Sparse-RL reference: no prefill compression
    nl = CompressionSchedule(CompressionConfig(method="snapkv", budget=10, window=2, buffer=4, trigger_on_newline=True))
    assert [nl.after_decode(n, True) for n in (10, 11)] == [False, True]
    due = nl.due_after_decode(torch.tensor([10, 11, 12, 14]), torch.tensor([True, True, False, False]))
    assert due.tolist() == [False, True, False, True]
    pre = CompressionSchedule(CompressionConfig(method="snapkv", budget=10, window=2, buffer=4, compress_prefill=True))
    assert [pre.after_prefill(n) for n in (10, 11)] == [False, True]
    assert pre.due_after_prefill(torch.tensor([10, 11])).tolist() == [False, True]
    dense = CompressionSchedule(CompressionConfig())
    assert not dense.after_decode(10**6) and not dense.due_after_decode(torch.tensor([10**6])).any()


def test_schedule_candidates_and_capacity():
    all_ = CompressionSchedule(CompressionConfig(method="rkv", budget=10, window=2, buffer=4))
    resp = CompressionSchedule(CompressionConfig(method="rkv", budget=10, window=2, buffer=4, scope="response"))
    assert all_.candidate_start(torch.tensor([7, 3])).tolist() == [0, 0]
    assert resp.candidate_start(torch.tensor([7, 3])).tolist() == [7, 3]
    assert all_.capacity(5, 100) == 14          # oscillates between B and B + W
    assert all_.capacity(5, 3) == 7             # never reaches B + W: prompt + 2 fed tokens
    assert all_.capacity(30, 100) == 31         # long prompt: first decode token attended, then cut to B
    assert resp.capacity(30, 100) == 44         # prompt + B + W
    assert CompressionSchedule(CompressionConfig()).capacity(30, 100) == 129


def test_digest_byte_format():
    pos = torch.tensor([[0, 3, 5], [1, 2, 5]])
    d = KeptDigest()
    assert d.hexdigest() is None
    d.update(2, 1, pos)
    ref = hashlib.sha256(((2 << 16) + 1).to_bytes(8, "little"))
    for v in [0, 3, 5, 1, 2, 5]:
        ref.update(int(v).to_bytes(8, "little", signed=True))
    assert d.hexdigest() == ref.hexdigest()
    c = d.copy()
    c.update(3, 0, pos)
    assert c.hexdigest() != d.hexdigest() and d.hexdigest() == ref.hexdigest()


def test_digest_update_layers_equals_per_layer_updates():
    positions = torch.arange(3 * 2 * 4).reshape(3, 2, 4)
    a, b = KeptDigest(), KeptDigest()
    a.update_layers(5, positions)
    for layer in range(3):
        b.update(5, layer, positions[layer])
    assert a.hexdigest() == b.hexdigest() and a.updates == b.updates == 3
