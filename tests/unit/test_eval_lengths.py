"""Lengths checked before an eval loads its model: prompt + max new tokens against the context, and whether a
prompt can reach a compression at all (the schedule's answer matches what the HF engine really does)."""
import pytest

from sparse_rl_megatron.compression import CompressionConfig, CompressionSchedule
from sparse_rl_megatron.eval.lengths import context_error, dense_prompts
from sparse_rl_megatron.eval.report import sampling_label
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.models.tiny import build_tiny_model

B, W = 16, 4  # compress when 20 candidates are cached


def _schedule(**kw):
    return CompressionSchedule(CompressionConfig(method="rkv", budget=B, window=2, buffer=W, **kw))


def test_may_compress_thresholds():
    s = _schedule()
    # the most tokens cached: prompt + max_new - 1 (the last sampled token is never fed back)
    assert s.may_compress(10, 11) and not s.may_compress(10, 10)
    assert s.may_compress(25, 1) is False  # one new token: no decode step, no check after prefill
    assert s.may_compress(25, 2)  # the first decode step sees 26 >= 20
    r = _schedule(scope="response")  # only response tokens are candidates
    assert r.may_compress(100, 21) and not r.may_compress(100, 20)
    assert _schedule(trigger_on_newline=True).may_compress(10, 8)  # 17 > B: a newline may trigger it
    assert _schedule(compress_prefill=True).may_compress(17, 1)  # over budget at prefill
    assert not CompressionSchedule(CompressionConfig()).may_compress(10_000, 10_000)  # dense
    assert dense_prompts(s, [5, 9, 10, 30], 11) == 2


@pytest.mark.parametrize("max_new", [10, 11])
def test_may_compress_matches_the_engine(max_new):
    model = build_tiny_model("qwen2", seed=0)
    engine = HFRolloutEngine(model, None, compression=_schedule().config, show_progress=False)
    prompt = list(range(3, 13))  # 10 token ids
    (sample,) = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_new_tokens=max_new,
                                                             ignore_eos=True))
    assert sample.response_length == max_new
    assert (sample.compression.events > 0) == _schedule().may_compress(len(prompt), max_new) == (max_new == 11)


def test_context_error_names_the_option_and_the_value_that_fits():
    assert context_error("gsm8k", 232, 7960, 8192) is None
    assert context_error("gsm8k", 232, 8192, 8192) == (
        "gsm8k: the longest prompt (232 tokens) + 8192 new tokens exceed the model's context of 8192 tokens "
        "(max_position_embeddings); lower --max-new-tokens to 7960 or less (or for this benchmark alone: "
        "--bench gsm8k:max_new_tokens=7960)")
    assert context_error("aime24", 9000, 10, 8192).endswith("the prompt alone fills it: leave aime24 out of --benchmarks")


def test_sampling_label_prints_only_what_is_in_effect():
    assert sampling_label(0.0, 0.95) == "greedy"
    assert sampling_label(0.8, 0.95) == "T=0.8 top-p=0.95"
    assert sampling_label(1.0, 1.0) == "T=1.0"
