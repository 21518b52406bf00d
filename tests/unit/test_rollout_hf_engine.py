"""HFRolloutEngine against plain HF generation, full forward passes, and masked-forward oracles."""
import numerics
import pytest
import torch
from transformers import AttentionInterface

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import RolloutEngine, SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.rollout.kv_cache import CompressedKVCache
from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer

PROMPTS = ["Let x be a real number such that", "The answer is", "First, 2 + 3 = 5. Then 5 * 4 = 20. Finally"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    # init_std 0.2: peaked distributions and attention, so evicting the wrong token would show
    return build_tiny_model("qwen2", init_std=0.2, seed=1)


def _tol(model, samples):
    """The bound of ``numerics.hf_logprob_tolerance`` for these samples' log-probs (engine vs any reference)."""
    return numerics.hf_logprob_tolerance(model, [s.prompt_ids for s in samples], [s.response_ids for s in samples])


def _close(got, want, tol, what):
    numerics.assert_logprobs_within(got, want, tol, f"hf_engine/{what}")


def _engine(model, tok, **kw):
    return HFRolloutEngine(model, tok, show_progress=False, **kw)


def _forward_logprobs(model, sample, attention_mask=None):
    """log pi(y_t) of every response token from one full forward over prompt + response."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention_mask).logits[0].float()
    p = len(sample.prompt_ids)
    return torch.log_softmax(logits[p - 1:], dim=-1).gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def _tiny_qwen3():
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        return AutoModelForCausalLM.from_config(config).eval()


# Llama 3.x RoPE scaling shrunk to matter within the test's ~40 positions: at head_dim 16 and theta 100 the
# wavelengths are 6.3, 11.2, 19.9, 35.3, ... 353 tokens; thresholds 32 / 4 = 8 and 32 / 1 = 32 keep the first,
# interpolate the next two and divide the other five by 8 (Llama 3.1 itself: factor 8, 1, 4, 8192).
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)


def _model(family):
    if family == "qwen3":
        return _tiny_qwen3()
    if family == "llama3":
        return build_tiny_model("llama", init_std=0.2, seed=2, rope_theta=100.0, rope_scaling=LLAMA3_ROPE)
    return build_tiny_model(family, init_std=0.2, seed=2)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "llama3"])
def test_dense_greedy_matches_hf_generate(tok, family):
    model = _model(family)
    engine = _engine(model, tok)
    assert isinstance(engine, RolloutEngine)
    samples = engine.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    tol = _tol(model, samples)
    for s in samples:  # the batch mixes prompt lengths; each reference runs alone, without padding
        ids = torch.tensor([s.prompt_ids])
        out = model.generate(ids, max_new_tokens=24, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        ref_tokens = out.sequences[0, ids.shape[1]:].tolist()
        assert s.response_ids == ref_tokens
        ref_lp = torch.stack([torch.log_softmax(l[0].float(), -1)[t] for l, t in zip(out.logits, ref_tokens)])
        _close(s.sampler_logprobs, ref_lp, tol, f"greedy_vs_generate[{family}]")
        _close(s.sampler_logprobs, _forward_logprobs(model, s), tol, f"greedy_vs_forward[{family}]")
        assert s.sampler_logprobs_scaled.abs().max() == 0  # greedy: a point mass


def test_llama3_rope_scaling_changes_the_model():
    """The llama3 case above is a real check: the same weights with plain RoPE decode differently."""
    scaled = _model("llama3")
    plain = build_tiny_model("llama", init_std=0.2, seed=2, rope_theta=100.0)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (scaled(ids).logits - plain(ids).logits).abs().amax(-1)[0]
    assert diff[0] == 0 and diff[8:].min() > 1e-2  # position 0 rotates by 0 either way


def test_sampled_logprobs_match_full_forward(model, tok):
    engine = _engine(model, tok)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, ignore_eos=True)
    for s in engine.generate(PROMPTS, 2, sampling):
        _close(s.sampler_logprobs, _forward_logprobs(model, s), _tol(model, [s]), "sampled_vs_forward")
        torch.testing.assert_close(s.sampler_logprobs_scaled, s.sampler_logprobs)  # T=1, no filter
    warm = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, seed=3, ignore_eos=True)
    for s in engine.generate(PROMPTS[:1], 2, warm):
        _close(s.sampler_logprobs, _forward_logprobs(model, s), _tol(model, [s]), "filtered_vs_forward")
        assert (s.sampler_logprobs_scaled > s.sampler_logprobs - 1e-6).all()  # filtered + sharpened


@pytest.mark.parametrize("method", ["rkv", "snapkv", "streamingllm", "h2o", "triattention"])
def test_budget_at_least_length_is_identical_to_dense(model, tok, method):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5, ignore_eos=True)
    dense = _engine(model, tok).generate(PROMPTS, 2, sampling)
    config = CompressionConfig(method=method, budget=64, window=4, buffer=8)
    sparse = _engine(model, tok, compression=config).generate(PROMPTS, 2, sampling)
    for d, s in zip(dense, sparse):
        assert s.response_ids == d.response_ids
        _close(s.sampler_logprobs, d.sampler_logprobs, _tol(model, [d]), f"no_eviction_vs_dense[{method}]")
        assert s.compression.events == 0 and s.compression.kept_digest is None
        assert s.compression.method == method and s.compression.budget == 64


def _capture_attended(monkeypatch):
    """Record, for every decode_write call, the logical positions each (layer, head) attends."""
    seen = []
    original = CompressedKVCache.decode_write

    def spy(self, layer, k, v, q, mask):
        out = original(self, layer, k, v, q, mask)
        length = mask.shape[-1]
        seen.append((layer, int(self.next_pos[0]), self.pos[layer][0, :, :length].clone(),
                     mask[0, 0, 0].clone()))
        return out

    monkeypatch.setattr(CompressedKVCache, "decode_write", spy)
    return seen


def _visibility(seen, num_layers, num_kv_heads, total):
    """[layers] of [Hkv, T, T] bool: causal for the prompt, the recorded retained set for decode queries."""
    vis = [torch.ones(num_kv_heads, total, total, dtype=torch.bool).tril() for _ in range(num_layers)]
    for layer, p, pos, live in seen:
        vis[layer][:, p] = False
        for h in range(num_kv_heads):
            vis[layer][h, p, pos[h][live]] = True
    return vis


def test_streamingllm_eviction_matches_masked_full_forward(model, tok, monkeypatch):
    seen = _capture_attended(monkeypatch)
    config = CompressionConfig(method="streamingllm", budget=12, window=2, buffer=4, sink_tokens=2)
    engine = _engine(model, tok, compression=config)
    s = engine.generate(PROMPTS[1:2], 1, SamplingParams(temperature=1.0, max_new_tokens=40, seed=7,
                                                        ignore_eos=True))[0]
    assert s.compression.events >= 5
    # Independent simulation of StreamingLLM's retention (sinks + most recent, same for every head).
    p0, total = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids) - 1
    visible = torch.ones(total, total, dtype=torch.bool).tril()
    kept = list(range(p0))
    for p in range(p0, total):
        kept.append(p)
        visible[p] = False
        visible[p, kept] = True
        if len(kept) >= config.budget + config.buffer:
            kept = kept[: config.sink_tokens] + kept[-(config.budget - config.sink_tokens):]
    for layer, p, pos, live in seen:  # the engine attended exactly that set, in every layer and head
        for h in range(pos.shape[0]):
            assert sorted(pos[h][live].tolist()) == torch.nonzero(visible[p]).flatten().tolist()
    # True positions (RoPE) and the kept K/V reproduce a dense forward that only masks the evicted tokens.
    ref = _forward_logprobs(model, s, attention_mask=visible[None, None])
    tol = _tol(model, [s])
    _close(s.sampler_logprobs, ref, tol, "streamingllm_vs_masked_forward")
    dense_ref = _forward_logprobs(model, s)
    assert (s.sampler_logprobs - dense_ref).abs().max() > 10 * tol  # eviction did change the distribution


_ORACLE_MASKS: list[torch.Tensor] = []


def _per_head_masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention with a per-(layer, KV head) visibility mask from _ORACLE_MASKS."""
    groups = module.num_key_value_groups
    mask = _ORACLE_MASKS[module.layer_idx].repeat_interleave(groups, dim=0)[None]       # [1, Hq, T, T]
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = (torch.matmul(query, k.transpose(-1, -2)) * scaling).masked_fill(~mask, float("-inf"))
    return torch.matmul(weights.softmax(dim=-1), v).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("method", ["rkv", "h2o", "triattention"])
def test_per_head_eviction_matches_per_head_masked_forward(tok, monkeypatch, method):
    model = build_tiny_model("qwen2", init_std=0.2, seed=1)
    seen = _capture_attended(monkeypatch)
    config = CompressionConfig(method=method, budget=12, window=3, buffer=5)
    s = _engine(model, tok, compression=config).generate(
        PROMPTS[2:], 1, SamplingParams(temperature=1.0, max_new_tokens=36, seed=11, ignore_eos=True))[0]
    assert s.compression.events >= 4  # the 19-token prompt exceeds B + W: kept whole until the first decode step
    assert s.compression.peak_kv_tokens == len(s.prompt_ids) + 1
    total = len(s.prompt_ids) + len(s.response_ids) - 1
    masks = _visibility(seen, model.config.num_hidden_layers, model.config.num_key_value_heads, total)
    assert not torch.equal(masks[0][0], masks[0][1]) or not torch.equal(masks[0][0], masks[1][0])  # per head/layer
    tol = _tol(model, [s])  # with the model's own attention (the oracle's masks are sized for one sequence)
    AttentionInterface.register("sparse_rl_test_per_head", _per_head_masked_attention)
    _ORACLE_MASKS[:] = masks
    model.set_attn_implementation("sparse_rl_test_per_head")
    ref = _forward_logprobs(model, s)
    _close(s.sampler_logprobs, ref, tol, f"per_head_{method}_vs_masked_forward")


def test_events_peak_and_provenance(model, tok):
    config = CompressionConfig(method="snapkv", budget=16, window=4, buffer=8)
    engine = _engine(model, tok, compression=config, weight_version=3)
    samples = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=40, seed=0, ignore_eos=True))
    assert [(s.group_id, s.index_in_group) for s in samples] == [(g, i) for g in range(3) for i in range(2)]
    for s in samples:
        cached = len(s.prompt_ids) + 40 - 1  # the last sampled token is never fed back
        assert s.compression.events == 1 + (cached - 24) // 8
        assert s.compression.peak_kv_tokens == 24
        assert (s.compression.method, s.compression.budget, s.compression.window, s.compression.buffer,
                s.compression.scope) == ("snapkv", 16, 4, 8, "all")
        assert len(s.compression.kept_digest) == 64 and s.weight_version == 3
        assert s.response_text == tok.decode(s.response_ids, skip_special_tokens=True)
        assert s.prompt_text in PROMPTS and s.finish_reason == "length"
    dense = _engine(model, tok).generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=5, seed=0))[0]
    assert dense.compression.method == "none" and dense.compression.budget is None
    assert dense.compression.peak_kv_tokens == len(dense.prompt_ids) + len(dense.response_ids) - 1


def test_scope_response_and_prefill_compression(model, tok):
    long_prompt = " ".join(PROMPTS)
    resp = CompressionConfig(method="rkv", budget=8, window=2, buffer=4, scope="response")
    s = _engine(model, tok, compression=resp).generate([long_prompt], 1,
                                                       SamplingParams(max_new_tokens=30, seed=0, ignore_eos=True))[0]
    p = len(s.prompt_ids)
    assert p > 12 and s.compression.peak_kv_tokens == p + 12 and s.compression.events == 1 + (29 - 12) // 4
    pre = CompressionConfig(method="snapkv", budget=8, window=2, buffer=4, compress_prefill=True)
    s = _engine(model, tok, compression=pre).generate([long_prompt], 1, SamplingParams(max_new_tokens=1))[0]
    assert s.compression.events == 1 and s.compression.peak_kv_tokens == p
    no_pre = CompressionConfig(method="snapkv", budget=8, window=2, buffer=4)
    s = _engine(model, tok, compression=no_pre).generate([long_prompt], 1,
                                                         SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert s.compression.events == 1 and s.compression.peak_kv_tokens == p + 1  # cut at the first decode step


def test_seeds_and_batching(model, tok):
    config = CompressionConfig(method="rkv", budget=12, window=2, buffer=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, seed=42, ignore_eos=True)
    a = _engine(model, tok, compression=config).generate(PROMPTS, 3, sampling)
    b = _engine(model, tok, compression=config, max_batch_size=2).generate(PROMPTS, 3, sampling)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]  # independent of batching
    assert [s.compression.kept_digest for s in a] == [s.compression.kept_digest for s in b]
    assert len({tuple(s.response_ids) for s in a}) == len(a)            # samples of a group differ
    other = SamplingParams(temperature=1.0, max_new_tokens=20, seed=43, ignore_eos=True)
    c = _engine(model, tok, compression=config).generate(PROMPTS, 3, other)
    assert all(x.response_ids != y.response_ids for x, y in zip(a, c))


def test_eos_and_stop_strings(tok):
    model = build_tiny_model("qwen2", init_std=0.2, seed=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    free = _engine(model, tok).generate(PROMPTS[:1], 1, greedy)[0]
    eos = free.response_ids[5]
    first = free.response_ids.index(eos)
    model.generation_config.eos_token_id = eos
    s = _engine(model, tok).generate(PROMPTS[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=30))[0]
    assert s.finish_reason == "eos" and s.response_ids == free.response_ids[: first + 1]
    assert len(_engine(model, tok).generate(PROMPTS[:1], 1, greedy)[0].response_ids) == 30  # ignore_eos
    model.generation_config.eos_token_id = None
    text = tok.decode(free.response_ids[:12])
    stop = text[-3:]
    s = _engine(model, tok).generate(PROMPTS[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=30,
                                                                       stop=[stop], ignore_eos=True))[0]
    assert s.finish_reason == "stop" and stop in tok.decode(s.response_ids) and len(s.response_ids) <= 12
    assert stop not in tok.decode(s.response_ids[:-1])


def test_bad_requests_are_refused(model, tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; valid: llama, qwen2, qwen3"):
        HFRolloutEngine(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    engine = _engine(model, tok)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate(["hi", []], 1, SamplingParams())
    with pytest.raises(ValueError, match=r"token ids outside \[0, 512\)"):
        engine.generate([[1, 999]], 1, SamplingParams())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=9000))
    with pytest.raises(ValueError, match="no tokenizer"):
        HFRolloutEngine(model, show_progress=False).generate(["text"], 1, SamplingParams())
    with pytest.raises(ValueError, match="n must be >= 1"):
        engine.generate(["hi"], 0, SamplingParams())


def test_rows_finishing_at_different_times_match_rows_run_alone(tok):
    model = build_tiny_model("qwen2", init_std=0.2, seed=1)
    config = CompressionConfig(method="rkv", budget=12, window=2, buffer=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30, seed=9)
    free = _engine(model, tok, compression=config).generate(
        PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=30, seed=9, ignore_eos=True))
    counts = {}
    for s in free:
        for t in set(s.response_ids[2:20]):
            counts[t] = counts.get(t, 0) + 1
    model.generation_config.eos_token_id = max(counts, key=counts.get)  # ends some rows early, not all
    batched = _engine(model, tok, compression=config, max_batch_size=12).generate(PROMPTS, 4, sampling)
    alone = _engine(model, tok, compression=config, max_batch_size=1).generate(PROMPTS, 4, sampling)
    lengths = {len(s.response_ids) for s in batched}
    assert len(lengths) >= 3 and {s.finish_reason for s in batched} == {"eos", "length"}
    for a, b in zip(batched, alone):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        _close(a.sampler_logprobs, b.sampler_logprobs, _tol(model, [a]), "batched_vs_alone")
        assert (a.compression.events, a.compression.peak_kv_tokens, a.compression.kept_digest) == \
            (b.compression.events, b.compression.peak_kv_tokens, b.compression.kept_digest)


def test_newline_trigger_in_the_engine(model, tok, monkeypatch):
    engine = _engine(model, tok, compression=CompressionConfig(
        method="snapkv", budget=8, window=2, buffer=100, trigger_on_newline=True))
    mask = engine._newline_mask()
    assert mask.tolist() == ["\n" in tok.decode([i]) for i in range(model.config.vocab_size)] and mask.any()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30, seed=4, ignore_eos=True)
    s = engine.generate(PROMPTS[:1], 1, sampling)[0]
    fed = s.response_ids[:-1]
    # pretend the most frequent sampled token is a newline: every time it is fed with > B cached, compress
    newline_id = max(set(fed), key=fed.count)
    monkeypatch.setattr(engine, "_newline_ids", torch.arange(model.config.vocab_size) == newline_id)
    s2 = engine.generate(PROMPTS[:1], 1, sampling)
    assert s2[0].compression.events >= 1 and s2[0].compression.peak_kv_tokens < len(s.prompt_ids) + 29


# ---- teacher_forced: the oracle other engines are checked against ------------------------------------
# Feeding the engine's own samples back must reproduce their log-probs and every compression record (events,
# peak, kept digest) exactly; a dense engine must agree with a full forward pass.

def _records(samples):
    return [(s.compression.events, s.compression.peak_kv_tokens, s.compression.kept_digest) for s in samples]


@pytest.mark.parametrize("config", [
    CompressionConfig(method="rkv", budget=10, window=3, buffer=4),
    CompressionConfig(method="snapkv", budget=10, window=3, buffer=4, scope="response"),
    CompressionConfig(method="streamingllm", budget=12, window=2, buffer=4, sink_tokens=2),
    CompressionConfig(method="h2o", budget=10, window=3, buffer=4),
    CompressionConfig(method="triattention", budget=10, window=3, buffer=4),
], ids=lambda c: f"{c.method}-{c.scope}")
def test_replaying_own_samples_reproduces_logprobs_and_kept_sets(model, tok, config):
    engine = _engine(model, tok, compression=config, max_batch_size=4)
    # Rows finish at different steps (EOS allowed), prompts have mixed lengths, groups of 2 share a prompt.
    samples = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=30, seed=4))
    assert max(s.compression.events for s in samples) >= 3
    replay = engine.teacher_forced([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for s, r in zip(samples, replay):
        assert r.response_ids == s.response_ids and r.prompt_ids == s.prompt_ids
        _close(r.sampler_logprobs, s.sampler_logprobs, _tol(model, [s]), f"replay_vs_sampled[{config.method}]")
        assert r.sampler_logprobs_scaled is None and r.metadata["teacher_forced"] is True
    assert _records(replay) == _records(samples)
    if config.method != "streamingllm":  # content-based scorers: another history keeps other tokens
        other = engine.teacher_forced([samples[0].prompt_ids], [list(reversed(samples[0].response_ids))])[0]
        assert other.compression.kept_digest != samples[0].compression.kept_digest


def test_dense_teacher_forced_equals_full_forward(model, tok):
    responses = [[5, 17, 42, 99, 7, 300], [12, 8, 3]]
    out = _engine(model, tok).teacher_forced(PROMPTS[:2], responses)
    for s, resp in zip(out, responses):
        ids = torch.tensor([s.prompt_ids + resp])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        p = len(s.prompt_ids)
        ref = logp[p - 1:-1].gather(-1, torch.tensor(resp)[:, None])[:, 0]
        _close(s.sampler_logprobs, ref, _tol(model, [s]), "teacher_forced_vs_forward")
        assert s.compression.events == 0 and s.finish_reason == "length"


def test_teacher_forced_refuses_bad_input(model, tok):
    engine = _engine(model, tok)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        engine.teacher_forced(PROMPTS[:2], [[1, 2]])
    with pytest.raises(ValueError, match="response 0 is empty"):
        engine.teacher_forced(PROMPTS[:1], [[]])
    with pytest.raises(ValueError, match="outside"):
        engine.teacher_forced(PROMPTS[:1], [[10**6]])
    engine.release_memory()
    with pytest.raises(RuntimeError, match="teacher_forced called after release_memory"):
        engine.teacher_forced(PROMPTS[:1], [[1]])


def test_triattention_online_centers_are_the_rows_own_queries(model, tok, tmp_path):
    """After generation, each row's online centers sum every token it fed, at its position: in layer 0 (whose
    queries see no attention yet) exactly those of one dense prefill over its prompt + response; centers calibrated at the same weights and loaded from a file keep other tokens
    than online ones (a row's own queries, not a pool's)."""
    from sparse_rl_megatron.rollout import centers as centers_mod
    from sparse_rl_megatron.rollout.hf_forward import HFDecoder

    config = CompressionConfig(method="triattention", budget=10, window=2, buffer=4)
    engine = _engine(model, tok, compression=config)
    caches = []
    original = engine._new_cache
    engine._new_cache = lambda *a, **kw: caches.append(original(*a, **kw)) or caches[-1]
    s = engine.generate(PROMPTS[:1], 1, SamplingParams(temperature=1.0, max_new_tokens=24, seed=3,
                                                       ignore_eos=True))[0]
    assert s.compression.events >= 3
    fed = s.prompt_ids + s.response_ids[:-1]
    cache = caches[-1]
    decoder = HFDecoder(model)
    center, abs_center = centers_mod.calibrate_centers(decoder, torch.tensor([fed]), torch.tensor([len(fed)]))
    count = cache.qcount[:, 0][:, None, None]
    assert cache.qcount[:, 0].tolist() == [float(len(fed))] * model.config.num_hidden_layers
    torch.testing.assert_close((cache.qsum[:, 0] / count)[0], center[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close((cache.qabs[:, 0] / count)[0], abs_center[0], atol=1e-5, rtol=1e-4)
    # layer 1's queries come from the compressed cache's attention, not the dense one's
    assert not torch.allclose((cache.qsum[:, 0] / count)[1], center[1], atol=1e-3)
    # fixed centers from a file: calibrated on other text, they rank the same row's keys differently
    other = torch.tensor([tok.encode(PROMPTS[2])])
    path = str(tmp_path / "centers.pt")
    centers_mod.save_centers(path, centers_mod.calibrate_centers(decoder, other, torch.tensor([other.shape[1]])))
    fixed = CompressionConfig(method="triattention", budget=10, window=2, buffer=4, triattention_centers="file",
                              triattention_centers_path=path)
    replay = _engine(model, tok, compression=fixed).teacher_forced([s.prompt_ids], [s.response_ids])[0]
    assert replay.compression.events == s.compression.events
    assert replay.compression.kept_digest != s.compression.kept_digest
