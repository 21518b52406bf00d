"""SGLangRolloutEngine serving a mixture of experts (a tiny Qwen3-MoE; the Qwen2-MoE with its gated shared expert is
trained with this engine in test_train_sglang_moe.py) with the sparse_kv plugin on SGLang's CPU engine (its torch-native MoE path: ``UnquantizedFusedMoEMethod.forward_cpu`` ->
``moe_forward_native``), against the HF reference engine: dense log-probs against a full forward, compressed samples
against ``HFRolloutEngine.teacher_forced`` (log-probs within ``numerics.hf_logprob_tolerance``, same compression
record), a weight push of per-expert checkpoint tensors, SGLang's routed experts (R3) right for dense requests and
refused for compressed ones, and a tied-embedding MoE refused at start. One engine for the module."""
from __future__ import annotations

import base64

import pytest
import torch
from sglang_helpers import assert_logprobs_match, assert_matches_reference, full_forward_logprobs, scheduler_env, \
    teacher_forced

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

SERVER = CompressionConfig(method="rkv", budget=12, window=3, buffer=4)
PROMPTS = [[5, 17, 42], [300, 12, 8, 77, 41, 9, 250, 33, 6], list(range(100, 121))]
MODEL_SEED, INIT_STD = 3, 0.2


@pytest.fixture(scope="module", params=["qwen3_moe"])
def served(request, tmp_path_factory):
    """(engine, its HF twin, the model directory): 4 experts of width 64, top-2, untied (as the published ones)."""
    from sparse_rl_megatron.models.tiny import build_tiny_model, save_tiny_hf_checkpoint
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    family = request.param
    model_dir = save_tiny_hf_checkpoint(tmp_path_factory.mktemp(family), family, seed=MODEL_SEED, init_std=INIT_STD)
    config = SGLangEngineConfig(model_path=str(model_dir), compression=SERVER, dtype="float32", max_total_tokens=2048,
                                kept_digest=True, extra_args={"enable_return_routed_experts": True})
    with scheduler_env():
        engine = SGLangRolloutEngine(config)
    yield engine, build_tiny_model(family, seed=MODEL_SEED, init_std=INIT_STD), model_dir
    engine.shutdown()


def test_dense_logprobs_match_a_full_forward(served):
    engine, hf_model, _ = served
    samples = engine.generate(PROMPTS[:2], 2, SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True))
    for s in samples:
        assert s.compression.events == 0
        ref = full_forward_logprobs(hf_model, s.prompt_ids, s.response_ids)
        assert_logprobs_match(s.sampler_logprobs, ref, hf_model, s.prompt_ids, s.response_ids, "moe_no_event_vs_forward")


@pytest.mark.parametrize("scope", ["all", "response"])
def test_compressed_samples_match_the_teacher_forced_reference(served, scope):
    engine, hf_model, _ = served
    config = CompressionConfig(method="rkv", budget=12, window=3, buffer=4, scope=scope)
    samples = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=28, seed=1),
                              compression=config)
    assert max(s.compression.events for s in samples) >= 3
    assert_matches_reference(samples, teacher_forced(hf_model, config, samples), hf_model)


def test_expert_weights_pushed_as_checkpoint_tensors(served, tmp_path):
    """The learner's export names every expert's matrices (as the hub checkpoints); SGLang loads them into its fused
    experts: samples then match the new weights' reference, and the old weights come back the same way."""
    from sparse_rl_megatron.models.tiny import build_tiny_model, save_tiny_hf_checkpoint
    from sparse_rl_megatron.rollout.weights import read_hf_safetensors

    engine, hf_model, model_dir = served
    family = hf_model.config.model_type
    other_dir = save_tiny_hf_checkpoint(tmp_path / "other", family, seed=11, init_std=INIT_STD)
    other = build_tiny_model(family, seed=11, init_std=INIT_STD)
    named = sorted(read_hf_safetensors(other_dir).items())
    assert any(".mlp.experts.3.down_proj.weight" in n for n, _ in named)
    engine.update_weights([named[: len(named) // 2], named[len(named) // 2:]], version=1)
    samples = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=20, seed=2))
    assert all(s.weight_version == 1 for s in samples)
    assert_matches_reference(samples, teacher_forced(other, SERVER, samples), other)
    engine.update_weights(sorted(read_hf_safetensors(model_dir).items()), version=2)
    samples = engine.generate(PROMPTS[:1], 2, SamplingParams(temperature=1.0, max_new_tokens=20, seed=2))
    assert_matches_reference(samples, teacher_forced(hf_model, SERVER, samples), hf_model)


def test_routed_experts_right_for_dense_requests_and_refused_for_compressed_ones(served):
    engine, hf_model, _ = served
    raw = engine.client.engine  # SGLang's own Engine: the routed experts are its API, not the RolloutEngine's
    prompt = PROMPTS[1]
    dense = raw.generate(input_ids=[prompt], sampling_params={
        "temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True, "custom_params": {"sparse_kv": {"method": "none"}}},
        return_routed_experts=True)[0]
    tokens = dense["output_ids"]
    raw_ids = base64.b64decode(dense["meta_info"]["routed_experts"])  # int32, little-endian, [T, layers, k]
    routed = torch.frombuffer(bytearray(raw_ids), dtype=torch.int32).reshape(
        len(prompt) + len(tokens) - 1, -1, hf_model.config.num_experts_per_tok).long()
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt + tokens[:-1]]), output_router_logits=True)
    want = torch.stack([torch.topk(r.float().softmax(-1), hf_model.config.num_experts_per_tok).indices
                        for r in out.router_logits], dim=1)  # [T, layers, k]
    assert torch.equal(routed.sort(-1).values, want.sort(-1).values)
    with pytest.raises(ValueError, match="return_routed_experts: SGLang reads a request's routed experts back through "
                                         "its req_to_token row, which sparse_kv rewrites"):
        raw.generate(input_ids=[prompt], sampling_params={"temperature": 0.0, "max_new_tokens": 20},
                     return_routed_experts=True)
    assert len(engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4))) == 1  # the engine keeps serving


def test_a_tied_embedding_moe_is_refused_at_start(tmp_path):
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    model_dir = save_tiny_hf_checkpoint(tmp_path / "tied", "qwen3_moe", seed=1, tie_word_embeddings=True)
    config = SGLangEngineConfig(model_path=str(model_dir), compression=SERVER, dtype="float32", max_total_tokens=2048)
    with pytest.raises(Exception, match="tie_word_embeddings=true: SGLang 0.5.23's qwen3_moe model never ties its LM "
                                        "head"):
        SGLangRolloutEngine(config)
