"""HFRolloutEngine.teacher_forced: the oracle other engines are checked against.

Feeding the reference engine's own samples back must reproduce their log-probs and every compression record
(events, peak, kept digest) exactly; a dense engine must agree with a full forward pass.
"""
import pytest
import torch

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.utils.tiny_models import build_tiny_model, build_tiny_tokenizer

PROMPTS = ["Let x be a real number such that", "The answer is", "First, 2 + 3 = 5. Then 5 * 4 = 20. Finally"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("qwen2", init_std=0.2, seed=1)


def _engine(model, tok, **kw):
    return HFRolloutEngine(model, tok, show_progress=False, **kw)


def _records(samples):
    return [(s.compression.events, s.compression.peak_kv_tokens, s.compression.kept_digest) for s in samples]


@pytest.mark.parametrize("config", [
    CompressionConfig(method="rkv", budget=10, window=3, buffer=4),
    CompressionConfig(method="snapkv", budget=10, window=3, buffer=4, scope="response"),
    CompressionConfig(method="streamingllm", budget=12, window=2, buffer=4, sink_tokens=2),
    CompressionConfig(method="h2o", budget=10, window=3, buffer=4),
], ids=lambda c: f"{c.method}-{c.scope}")
def test_replaying_own_samples_reproduces_logprobs_and_kept_sets(model, tok, config):
    engine = _engine(model, tok, compression=config, max_batch_size=4)
    # Rows finish at different steps (EOS allowed), prompts have mixed lengths, groups of 2 share a prompt.
    samples = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=30, seed=4))
    assert max(s.compression.events for s in samples) >= 3
    replay = engine.teacher_forced([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for s, r in zip(samples, replay):
        assert r.response_ids == s.response_ids and r.prompt_ids == s.prompt_ids
        torch.testing.assert_close(r.sampler_logprobs, s.sampler_logprobs, atol=1e-5, rtol=0)
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
        torch.testing.assert_close(s.sampler_logprobs, ref, atol=1e-5, rtol=0)
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
