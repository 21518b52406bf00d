"""Weight sync into the reference engine: state dicts, named tensors, HF directories; memory release."""
import pytest
import torch

from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_hf_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
PROMPT = [[5, 6, 7, 8, 9]]


def _tokens(engine):
    return engine.generate(PROMPT, 1, GREEDY)[0]


def test_load_weights_and_update_weights():
    target = build_tiny_model(init_std=0.2, seed=1)
    engine = HFRolloutEngine(build_tiny_model(init_std=0.2, seed=2), show_progress=False)
    want = _tokens(HFRolloutEngine(target, show_progress=False))
    assert _tokens(engine).response_ids != want.response_ids
    engine.load_weights(target.state_dict(), version=4)
    got = _tokens(engine)
    assert got.response_ids == want.response_ids and got.weight_version == 4
    torch.testing.assert_close(got.sampler_logprobs, want.sampler_logprobs)
    # a partial update (one bucket) changes the outputs and the version
    name = "model.layers.0.mlp.down_proj.weight"
    engine.update_weights([(name, torch.zeros_like(target.state_dict()[name]))], version=5)
    after = _tokens(engine)
    assert after.weight_version == 5 and not torch.equal(after.sampler_logprobs, got.sampler_logprobs)


def test_bad_weights_are_refused():
    engine = HFRolloutEngine(build_tiny_model(), show_progress=False)
    with pytest.raises(KeyError, match="'model.nope' is not a parameter"):
        engine.update_weights([("model.nope", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match=r"shape \(3,\) does not match"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1)
    partial = {"model.norm.weight": torch.ones(64)}
    with pytest.raises(KeyError, match="missing"):
        engine.load_weights(partial)
    assert engine.weight_version == 0


def test_hf_directory_round_trip(tmp_path):
    path = save_tiny_hf_checkpoint(tmp_path / "ckpt", seed=3, init_std=0.2)
    from_dir = HFRolloutEngine(str(path), show_progress=False)
    assert from_dir.tokenizer is not None  # the directory holds one
    text_sample = from_dir.generate(["The answer is"], 1, GREEDY)[0]
    assert text_sample.response_text == from_dir.tokenizer.decode(text_sample.response_ids, skip_special_tokens=True)
    other = HFRolloutEngine(build_tiny_model(init_std=0.2, seed=4), build_tiny_tokenizer(), show_progress=False)
    other.load_hf_dir(path, version=7)
    a, b = _tokens(from_dir), _tokens(other)
    assert a.response_ids == b.response_ids and b.weight_version == 7
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        other.load_hf_dir(tmp_path)


def test_release_and_resume_memory():
    engine = HFRolloutEngine(build_tiny_model(), show_progress=False)
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        _tokens(engine)
    engine.resume_memory()
    assert len(_tokens(engine).response_ids) == 12


def test_buckets_and_pairs_are_streamed():
    from sparse_rl_megatron.rollout.weights import iter_buckets, iter_pairs

    a, b, c = ("a", torch.zeros(1)), ("b", torch.ones(1)), ("c", torch.ones(2))
    pulled = []

    def stream():  # the learner's export: buckets made one at a time
        for bucket in ([a, b], [c]):
            pulled.append(len(pulled))
            yield bucket

    buckets = iter_buckets(stream())
    assert [n for n, _ in next(buckets)] == ["a", "b"] and pulled == [0]   # lazy: one bucket alive at a time
    assert [n for n, _ in next(buckets)] == ["c"] and pulled == [0, 1]
    # loose pairs between buckets form their own bucket; pairs come out of either form
    assert [[n for n, _ in bk] for bk in iter_buckets([a, b, [c], a])] == [["a", "b"], ["c"], ["a"]]
    assert [n for n, _ in iter_pairs([[a, b], c])] == ["a", "b", "c"]
    with pytest.raises(TypeError, match="pairs or buckets"):
        list(iter_buckets([torch.zeros(1)]))


def test_update_weights_takes_a_lazy_stream_of_buckets():
    target = build_tiny_model(init_std=0.2, seed=1)
    engine = HFRolloutEngine(build_tiny_model(init_std=0.2, seed=2), show_progress=False)
    named = list(target.state_dict().items())
    engine.update_weights((bucket for bucket in (named[:3], named[3:])), version=2)
    got, want = _tokens(engine), _tokens(HFRolloutEngine(target, show_progress=False))
    assert got.response_ids == want.response_ids and got.weight_version == 2
