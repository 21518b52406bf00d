"""task:modchain: problems, splits, formats, tokenizer, model directory, and generation from it."""
import random

import pytest
import torch

from sparse_rl_megatron.data.templates import render_prompt
from sparse_rl_megatron.tasks import TASKS, get_task
from sparse_rl_megatron.tasks.modchain import ModChainModel, ModChainSpec, ModChainTask
from sparse_rl_megatron.tasks.modchain_problems import (
    MULTIPLIERS, Problem, all_keys, make_problem, number_word, split_keys, vocabulary,
)

TINY = ModChainSpec(steps=6, heldout_size=40, heldout_variants=1, train_variants=2,
                    model=ModChainModel(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64))


@pytest.fixture(scope="module")
def task():
    return get_task("task:modchain")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ModChainTask(TINY).build_model(tmp_path_factory.mktemp("modchain") / "init", seed=3)


def test_registered_with_template_and_reward(task):
    from sparse_rl_megatron.data.templates import TEMPLATES
    from sparse_rl_megatron.rewards.registry import REWARDS

    assert "modchain" in TASKS and isinstance(task, ModChainTask)
    assert task.template in TEMPLATES and task.reward in REWARDS
    assert render_prompt(task.template, "Q aOne :") == "Q aOne :"


def test_worked_example():
    # x0 = 3, a = 7, b = 2: 3 -> 23 % 10 = 3 -> 3 ... (a fixed point of this map) ; x0 = 1: 1 -> 9 -> 5 -> 7
    p = Problem(1, 7, 2)
    assert p.states(4) == [9, 5, 7, 1]
    assert p.prompt() == "Q xOne aSeven bTwo :"
    assert p.solution(4) == "sOne nine sTwo five sThree seven sFour one \\boxed{1}"
    assert p.answer(4) == "1"
    assert [number_word(k) for k in (0, 7, 13, 20, 23, 99)] == ["Zero", "Seven", "Thirteen", "Twenty", "TwentyThree",
                                                                "NinetyNine"]


def test_splits_never_overlap_and_cover_all_problems():
    keys = split_keys(100)
    assert len(keys["heldout"]) == 100 and len(keys["train"]) == 300
    assert not set(keys["heldout"]) & set(keys["train"])
    assert sorted(keys["heldout"] + keys["train"]) == sorted(all_keys())
    assert {a for _, a, _ in all_keys()} == set(MULTIPLIERS)


def test_records_are_deterministic_disjoint_and_well_formed(task):
    train, heldout = task.records("train"), task.records("heldout")
    assert len(train) == 300 * 10 and len(heldout) == 100 * 4
    key = lambda r: (r.extra["x0"], r.extra["a"], r.extra["b"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in heldout}
    assert not {r.prompt for r in train} & {r.prompt for r in heldout}
    assert [r.prompt for r in task.records("train", seed=0)] == [r.prompt for r in train]
    assert [r.prompt for r in task.records("heldout", seed=1)] != [r.prompt for r in heldout]  # distractors move
    assert {key(r) for r in task.records("heldout", seed=1)} == {key(r) for r in heldout}  # problems do not
    assert len(task.records("train", limit=7)) == 7
    for r in list(heldout)[:20]:
        p = Problem(*key(r))
        assert r.answer == p.answer(30) and r.extra["solution"] == p.solution(30)
        assert r.extra["solution"].endswith(f"\\boxed{{{r.answer}}}")
        assert r.dataset == "modchain" and r.answer_style == "boxed" and r.metadata()["gold_answer"] == r.answer
        words = r.prompt.split()
        assert words[0] == "Q" and words[-1] == ":" and len(words) == task.prompt_tokens


def test_bad_split_and_spec_are_refused(task):
    with pytest.raises(ValueError, match="split must be one of train, heldout"):
        task.records("test")
    with pytest.raises(ValueError, match="distractors must be in"):
        ModChainSpec(distractors=50)
    with pytest.raises(ValueError, match="heldout_size must be in"):
        ModChainSpec(heldout_size=400)


def test_distractors_use_distinct_letters_and_shuffle_order():
    rng = random.Random(0)
    problems = [make_problem((1, 3, 5), 4, rng) for _ in range(20)]
    for p in problems:
        letters = [letter for letter, _ in p.distractors]
        assert len(set(letters)) == 4 and not set(letters) & {"x", "a", "b"}
    assert len({p.order for p in problems}) > 1


def test_tokenizer_round_trips_task_text_and_every_word_is_one_token(task, tiny_dir):
    from transformers import AutoTokenizer

    built = task.tokenizer()
    loaded = AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    for word in vocabulary(30):
        assert len(built(" " + word, add_special_tokens=False)["input_ids"]) == 1, word
    records = list(task.records("heldout", limit=10)) + list(task.records("train", limit=10))
    for r in records:
        text = f"{r.prompt} {r.extra['solution']}"
        ids = built(text, add_special_tokens=False)["input_ids"]
        assert built.decode(ids) == text
        assert len(ids) == task.prompt_tokens + task.response_tokens - 1  # EOS is not in the text
    # AutoTokenizer next to the qwen2 config loads a Qwen2Tokenizer; it must encode the same way
    small = ModChainTask(TINY)
    r = small.records("heldout", limit=1)[0]
    text = f"{r.prompt} {r.extra['solution']}"
    assert loaded(text, add_special_tokens=False)["input_ids"] == small.tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"


def test_model_dir_is_a_standard_qwen2_with_the_task_tokenizer(tiny_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tiny_dir), local_files_only=True)
    tok = ModChainTask(TINY).tokenizer()
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    assert config.vocab_size == len(tok) and config.eos_token_id == tok.eos_token_id
    assert config.pad_token_id == tok.pad_token_id and config.tie_word_embeddings
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (32, 1, 1)


def test_sft_examples_are_prompt_then_solution_then_eos(tiny_dir):
    from transformers import AutoTokenizer

    small = ModChainTask(TINY)
    tok = AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    examples = small.sft_examples(tok)
    assert len(examples) == len(small.records("train"))
    prompt, response = examples[0]
    r = small.records("train")[0]
    assert len(prompt) == small.prompt_tokens and len(response) == small.response_tokens
    assert response[-1] == tok.eos_token_id
    assert tok.decode(prompt) == r.prompt and tok.decode(response, skip_special_tokens=True) == " " + r.extra["solution"]


def test_hf_engine_generates_from_the_built_model_with_a_compressed_cache(tiny_dir):
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    small = ModChainTask(TINY)
    comp = CompressionConfig(method="rkv", budget=8, window=2, buffer=4)
    engine = HFRolloutEngine(str(tiny_dir), compression=comp, show_progress=False)
    records = small.records("heldout", limit=2)
    prompts = [render_prompt(small.template, r.prompt, engine.tokenizer) for r in records]
    samples = engine.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=small.response_tokens, seed=0,
                                                         ignore_eos=True))
    assert len(samples) == 4
    for s in samples:
        assert s.response_length == small.response_tokens and len(s.prompt_ids) == small.prompt_tokens
        assert s.compression.method == "rkv" and s.compression.budget == 8 and s.compression.events > 0
        assert s.compression.peak_kv_tokens <= 8 + 4
        assert torch.isfinite(s.sampler_logprobs).all() and (s.sampler_logprobs <= 0).all()
