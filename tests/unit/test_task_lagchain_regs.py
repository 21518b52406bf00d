"""``lagchain31_var_regs_weak`` (tasks/lagchain.py with ``register_tokens`` and the word box): a state is two words,
its register's letter and its value (``w eight``), so a step's read is the value word after its register's last
letter, 3L - 1 positions before the query (the letter just written); the box copies the last value word."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.tasks import get_task
from sparse_rl_megatron.tasks.lagchain import REGISTER_LETTERS, LagChainSpec, read_offset, record_key, states
from sparse_rl_megatron.tasks.modchain_problems import digit_word, parse_prompt


@pytest.fixture(scope="module")
def task():
    return get_task("lagchain31_var_regs_weak")


def test_a_state_is_its_registers_letter_then_its_value_word(task):
    for r in task.records("heldout", limit=60):
        lag = len(r.extra["initial"])
        xs = states(record_key(r), task.spec)
        words = r.extra["solution"].split()
        steps = [words[3 * k:3 * k + 3] for k in range(30)]
        assert [s[1] for s in steps] == [REGISTER_LETTERS[k % lag] for k in range(30)]
        assert [s[2] for s in steps] == [digit_word(x) for x in xs]
        assert words[90:] == ["\\boxed{", digit_word(xs[29]), "}"] and r.answer == digit_word(xs[29])
        assert r.extra["chain"].split() == words[:90]
        assert r.extra["shortcut_free"] == all(value != xs[29] for _, value in parse_prompt(r.prompt))


def test_the_read_lies_3L_minus_1_tokens_back_and_the_warm_start_keeps_it_and_its_letter(task):
    """At the token level: the query of step k's value (its register letter, just written) finds its register's
    previous value 3L - 1 tokens back and the same letter 3L back; those two keys are the ones the key dropout spares
    per example, and the box's word is the token written just before the box."""
    tok = task.tokenizer()
    examples, starts = task.sft_examples(tok)
    offsets = task.sft_read_offsets()
    records = task.records("train")
    checked = 0
    for (_, response), start, keep, r in list(zip(examples, starts, offsets, records))[:200]:
        lag = len(r.extra["initial"])
        assert keep == (read_offset(lag, True), read_offset(lag, True) + 1) == (3 * lag - 1, 3 * lag)
        assert read_offset(lag) == 2 * lag - 1  # the one-token states' distance is unchanged
        if start == len(response):  # the teacher's early stop: no box
            continue
        checked += 1
        assert len(response) == task.response_tokens == 96
        for k in range(lag, 30):
            query = 3 * k + 1  # the register letter of step k
            assert response[query - keep[1]] == response[query]  # the same register's letter, L steps back
            xs = states(record_key(r), task.spec)
            assert tok.decode([response[query - keep[0]]]).strip() == digit_word(xs[k - lag])
        assert response[start + 3] == response[start - 1]  # \ boxed { <the last value word> }
    assert checked > 100


def test_every_word_is_one_token_and_the_one_token_variants_are_unchanged(task):
    tok = task.tokenizer()
    for r in task.records("heldout", limit=20):
        text = f"{r.prompt} {r.extra['chain']}"
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == len(text.split())
    assert get_task("lagchain31_var_weak").response_tokens == 67 and task.prompt_tokens == 13


def test_a_word_box_needs_value_words():
    with pytest.raises(ValueError, match="answer_format 'word' needs register_tokens=True"):
        LagChainSpec(answer_format="word")
    with pytest.raises(ValueError, match="LagChainSpec.answer_format must be one of digits, word, got 'hex'"):
        LagChainSpec(answer_format="hex")
