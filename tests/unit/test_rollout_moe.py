"""HFRolloutEngine on mixtures of experts (Qwen3-MoE, Qwen2-MoE): decode against HF generation and full forwards,
compressed sampling against its own replay (the oracle the SGLang engine is checked against), and the routing kept
and replayed by ``teacher_forced`` (what ``sparse-rl mismatch`` uses to split the rho tail)."""
import numerics
import pytest
import torch

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.models.families import family_names
from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

PROMPTS = ["Let x be a real number such that", "The answer is", "First, 2 + 3 = 5. Then 5 * 4 = 20. Finally"]
FAMILIES = list(family_names(moe=True))
RKV = CompressionConfig(method="rkv", budget=12, window=4, buffer=4)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    # init_std 0.2: peaked distributions and attention; 4 experts of width 64, top-2
    return build_tiny_model(request.param, init_std=0.2, seed=2)


def _engine(model, tok):
    return HFRolloutEngine(model, tok, show_progress=False)


def _tol(model, samples):
    return numerics.hf_logprob_tolerance(model, [s.prompt_ids for s in samples], [s.response_ids for s in samples])


def _forward(model, sample):
    """log pi of the response tokens and the per-layer router top-k of the fed response tokens, one full forward."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids[:-1]])
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    p = len(sample.prompt_ids)
    lp = torch.log_softmax(out.logits[0, p - 1:].float(), -1).gather(-1, torch.tensor(sample.response_ids)[:, None])
    k = model.config.num_experts_per_tok
    experts = torch.stack([torch.topk(torch.softmax(r.float(), -1), k, dim=-1).indices[p:] for r in out.router_logits],
                          dim=1)  # [R - 1, layers, k]
    return lp[:, 0], experts


def test_dense_greedy_matches_hf_generate_and_forward(model, tok):
    samples = _engine(model, tok).generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=24,
                                                                     ignore_eos=True))
    tol = _tol(model, samples)
    for s in samples:
        ids = torch.tensor([s.prompt_ids])
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert s.response_ids == out[0, ids.shape[1]:].tolist()
        numerics.assert_logprobs_within(s.sampler_logprobs, _forward(model, s)[0], tol, "hf_engine/moe_greedy_vs_forward")


def test_compressed_samples_replay_to_the_same_logprobs_and_kept_sets(model, tok):
    """The oracle: teacher_forced through the same compression schedule gives back the sampler's log-probs (within
    the error model's bound: the replay prefills each pair alone, so the experts' matmuls get other token counts and
    may take other BLAS kernels) and kept-set digests, and the compression did act."""
    engine = _engine(model, tok)
    samples = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=30, seed=1, ignore_eos=True),
                              compression=RKV)
    assert min(s.compression.events for s in samples) >= 3
    replay = engine.teacher_forced([s.prompt_ids for s in samples], [s.response_ids for s in samples], compression=RKV)
    for s, r in zip(samples, replay):
        numerics.assert_logprobs_within(r.sampler_logprobs, s.sampler_logprobs, _tol(model, [s]),
                                        "hf_engine/moe_replay_vs_sampled")
        assert (s.compression.events, s.compression.kept_digest) == (r.compression.events, r.compression.kept_digest)


def test_routing_is_kept_and_replayed(model, tok):
    """Dense teacher_forced keeps the experts HF's own router picks (full forward); replaying a routing reproduces a
    replay exactly, and a different routing changes the log-probs (it is used). Compressed, the hidden states move,
    so part of the tokens go to other experts."""
    engine = _engine(model, tok)
    samples = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=30, seed=1, ignore_eos=True),
                              compression=RKV)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    dense = engine.teacher_forced(prompts, responses)
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    for d in dense:
        assert d.metadata["routing"].shape == (len(d.response_ids) - 1, layers, k)
        assert torch.equal(d.metadata["routing"].sort(-1).values, _forward(model, d)[1].sort(-1).values)
    again = engine.teacher_forced(prompts, responses, routing=[d.metadata["routing"] for d in dense])
    assert all(torch.equal(a.sampler_logprobs, d.sampler_logprobs) for a, d in zip(again, dense))
    shifted = [(d.metadata["routing"] + 1) % model.config.num_experts for d in dense]
    moved = engine.teacher_forced(prompts, responses, routing=shifted)
    assert all((m.sampler_logprobs[1:] - d.sampler_logprobs[1:]).abs().max() > 1e-2 for m, d in zip(moved, dense))
    assert all(torch.equal(m.sampler_logprobs[0], d.sampler_logprobs[0]) for m, d in zip(moved, dense))  # prefill
    compressed = engine.teacher_forced(prompts, responses, compression=RKV)
    flips = sum(int((c.metadata["routing"].sort(-1).values != d.metadata["routing"].sort(-1).values).any(-1).sum())
                for c, d in zip(compressed, dense))
    assert flips > 0


def test_bad_routing_is_refused(model, tok):
    engine = _engine(model, tok)
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    with pytest.raises(ValueError, match=r"routing\[0\] has shape \(2, 2, 2\); need \[3, 2, 2\]"):
        engine.teacher_forced(PROMPTS[:1], [[5, 6, 7, 8]], routing=[torch.zeros(2, layers, k)])
    with pytest.raises(ValueError, match=r"names experts outside \[0, 4\)"):
        engine.teacher_forced(PROMPTS[:1], [[5, 6]], routing=[torch.full((1, layers, k), 4)])
    with pytest.raises(ValueError, match="one tensor per pair"):
        engine.teacher_forced(PROMPTS[:2], [[5, 6], [7, 8]], routing=[torch.zeros(1, layers, k)])


def test_routing_on_a_dense_model_is_refused(tok):
    engine = _engine(build_tiny_model("qwen3", seed=2), tok)
    assert "routing" not in engine.teacher_forced(PROMPTS[:1], [[5, 6]])[0].metadata
    with pytest.raises(ValueError, match="not a mixture of experts"):
        engine.teacher_forced(PROMPTS[:1], [[5, 6]], routing=[torch.zeros(1, 2, 2)])


def test_generate_records_the_sampler_routes_at_prefill_and_decode(model, tok):
    """``record_routing``: every sample carries the experts of its prompt (prefill, the router's top-k of a full
    forward) and of its fed response tokens under its own compressed cache: what the oracle's compressed replay of the
    same tokens routes (routing replay in the learner takes these)."""
    engine = HFRolloutEngine(model, tok, show_progress=False, record_routing=True)
    # a stop string ends rows at different steps (a finished row is still fed until the batch drops it)
    samples = engine.generate(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=30, seed=1, stop=["e"]),
                              compression=RKV)
    assert max(s.compression.events for s in samples) >= 2 and len({s.response_length for s in samples}) > 2
    replay = engine.teacher_forced([s.prompt_ids for s in samples], [s.response_ids for s in samples], compression=RKV)
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    for s, r in zip(samples, replay):
        p = len(s.prompt_ids)
        assert s.routed_experts.shape == (p + s.response_length - 1, layers, k)
        assert torch.equal(s.routed_experts[p:].long(), r.metadata["routing"])
        assert torch.equal(s.routed_experts, r.routed_experts)
        ids = torch.tensor([s.prompt_ids])
        with torch.no_grad():
            logits = model(input_ids=ids, output_router_logits=True).router_logits
        prompt = torch.stack([torch.topk(g.float(), k, dim=-1).indices for g in logits], dim=1)  # [P, layers, k]
        assert torch.equal(s.routed_experts[:p].long().sort(-1).values, prompt.sort(-1).values)
    assert all(s.routed_experts is None for s in _engine(model, tok).generate(PROMPTS[:1], 1, SamplingParams(
        max_new_tokens=4, seed=1)))  # not recorded unless asked
