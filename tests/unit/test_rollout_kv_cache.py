"""The reference engine's per-head compressed KV cache, driven directly with synthetic K/V/Q."""
import pytest
import torch

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.kv_cache import CompressedKVCache

LAYERS, HKV, HQ, D = 2, 2, 4, 8


def _token_kv(rows, heads, positions, layer, gen):
    """Random K/V whose channel 0 encodes (layer, head, logical position), to check gathers."""
    k = torch.randn(rows, heads, len(positions), D, generator=gen)
    v = torch.randn(rows, heads, len(positions), D, generator=gen)
    tag = (torch.arange(heads)[:, None] * 10_000 + torch.as_tensor(positions)[None, :] + layer * 100_000).float()
    v[..., 0] = tag
    return k, v


def _run(config, prompt_lens, steps, newline_every=0, seed=0):
    """Prefill right-padded prompts then decode ``steps`` tokens; yields the cache after every step."""
    gen = torch.Generator().manual_seed(seed)
    rows, p = len(prompt_lens), max(prompt_lens)
    cache = CompressedKVCache(num_layers=LAYERS, rows=rows, num_kv_heads=HKV, num_q_heads=HQ, head_dim=D,
                              capacity=p + steps + 1, dtype=torch.float32, config=config, scaling=D ** -0.5,
                              rope_inv_freq=1.0 / 100 ** (torch.arange(0, D, 2) / D))
    lens = torch.tensor(prompt_lens)
    valid = torch.arange(p)[None] < lens[:, None]
    for layer in range(LAYERS):
        k, v = _token_kv(rows, HKV, list(range(p)), layer, gen)
        cache.prefill_write(layer, k, v, torch.randn(rows, HQ, p, D, generator=gen), valid)
    cache.finish_prefill(lens)
    cache.maybe_compress_after_prefill()
    yield cache
    for step in range(steps):
        mask = cache.decode_mask()
        for layer in range(LAYERS):
            k, v = _token_kv(rows, HKV, [0], layer, gen)
            v[..., 0] += cache.next_pos[:, None, None].float()  # tag with this row's logical position
            cache.decode_write(layer, k, v, torch.randn(rows, HQ, 1, D, generator=gen), mask)
        cache.finish_decode()
        newline = None
        if newline_every:
            newline = torch.full((rows,), (step + 1) % newline_every == 0)
        cache.maybe_compress_after_decode(newline)
        yield cache


def _check_consistent(cache, config, prompt_lens):
    """Every live slot holds the K/V of the logical token its pos entry names; order preserved; window kept."""
    for r in range(cache.rows):
        n = int(cache.lens[r])
        for layer in range(LAYERS):
            pos = cache.pos[layer][r, :, :n]
            tag = cache.v[layer][r, :, :n, 0]
            expect = torch.arange(HKV)[:, None] * 10_000 + pos + layer * 100_000
            assert torch.equal(tag, expect.float())
            assert bool((pos[:, 1:] > pos[:, :-1]).all())              # original order
            newest = torch.arange(int(cache.next_pos[r]) - config.window, int(cache.next_pos[r]))
            assert torch.equal(pos[:, -config.window:], newest.expand(HKV, -1))  # window always kept


@pytest.mark.parametrize("method", ["rkv", "snapkv", "h2o", "streamingllm", "triattention"])
def test_retained_length_bounded_and_drops_to_budget(method):
    config = CompressionConfig(method=method, budget=8, window=2, buffer=4, sink_tokens=2)
    prompt_lens = [5, 9]
    previous = None
    events = 0
    for cache in _run(config, prompt_lens, steps=30):
        assert int(cache.lens.max()) < config.budget + config.buffer  # compressed as soon as B + W is reached
        assert int(cache.peak.max()) <= config.budget + config.buffer
        if previous is not None:
            for r in range(2):
                if int(cache.events[r]) > previous[r]:
                    assert int(cache.lens[r]) == config.budget          # drops to exactly B
        previous = cache.events.tolist()
        _check_consistent(cache, config, prompt_lens)
        events = cache.events.tolist()
    # total cached tokens P + 30; first event when it reaches B + W = 12, then every W = 4 tokens
    assert events == [1 + (5 + 30 - 12) // 4, 1 + (9 + 30 - 12) // 4]
    if method in ("rkv", "snapkv", "triattention"):  # content-scored methods keep different tokens in different heads
        assert not torch.equal(cache.pos[0][0, 0, :8], cache.pos[0][0, 1, :8])
    elif method == "streamingllm":  # sinks + most recent in every head and layer: last event at 32 tokens
        assert cache.pos[1][0, 1, : int(cache.lens[0])].tolist() == [0, 1] + list(range(26, 35))


def test_scope_response_keeps_the_prompt_whole():
    config = CompressionConfig(method="rkv", budget=6, window=2, buffer=3, scope="response")
    prompt_lens = [7, 4]
    for cache in _run(config, prompt_lens, steps=25):
        assert (cache.num_candidates < config.budget + config.buffer).all()
        for r, p in enumerate(prompt_lens):
            for layer in range(LAYERS):
                assert cache.pos[layer][r, :, :p].tolist() == [list(range(p))] * HKV
    assert cache.lens.tolist() == [7 + int(cache.num_candidates[0]), 4 + int(cache.num_candidates[1])]
    assert cache.events.tolist() == [1 + (25 - 9) // 3] * 2
    _check_consistent(cache, config, prompt_lens)


def test_newline_trigger_compresses_above_budget():
    config = CompressionConfig(method="snapkv", budget=8, window=2, buffer=10, trigger_on_newline=True)
    lens = [int(c.lens[0]) for c in _run(config, [6], steps=12, newline_every=5)]
    # tokens: 6 after prefill, +1 per step; newline after steps 5 and 10 (counts 11 and 13 > B) -> back to 8
    assert lens == [6, 7, 8, 9, 10, 8, 9, 10, 11, 12, 8, 9, 10]


def test_prefill_compression_of_an_over_budget_prompt():
    config = CompressionConfig(method="snapkv", budget=8, window=2, buffer=4, compress_prefill=True)
    first = next(_run(config, [20, 6], steps=0))
    assert first.lens.tolist() == [8, 6] and first.events.tolist() == [1, 0]
    assert int(first.peak[0]) == 20
    no_prefill = next(_run(CompressionConfig(method="snapkv", budget=8, window=2, buffer=4), [20], steps=0))
    assert no_prefill.lens.tolist() == [20]


def test_select_rows_expands_and_drops_independently():
    config = CompressionConfig(method="rkv", budget=8, window=2, buffer=4)
    runner = _run(config, [10], steps=3)
    cache = next(runner)
    cache.select_rows(torch.tensor([0, 0, 0]))
    assert cache.rows == 3 and torch.equal(cache.k[1][0], cache.k[1][2])
    cache.digests[1].update(0, 0, torch.zeros(2, 8, dtype=torch.long))
    assert cache.digests[0].hexdigest() is None  # copies, not shared
    cache.select_rows(torch.tensor([2]))
    assert cache.rows == 1 and cache.lens.tolist() == [10]
