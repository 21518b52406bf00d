"""``ModChainSpec.answer_format``: the final answer boxed as digits (``\\boxed{12}``, a word-to-digits lookup) or as
the last state's own word (``\\boxed{ twelve }``, a copy of the token just written; the embedded default's task
``modchain31_wordbox_weak``, issue 38)."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.rewards.exact import exact_verdict
from sparse_rl_megatron.tasks import get_task
from sparse_rl_megatron.tasks.modchain import ModChainSpec
from sparse_rl_megatron.tasks.modchain_problems import (
    ANSWER_FORMATS, Problem, answer_text, answer_tokens, answer_value, digit_word,
)
from sparse_rl_megatron.tasks.modchain_teacher import EarlyStopTeacher


def test_the_formats_box_the_same_state_as_digits_or_as_its_word():
    assert ANSWER_FORMATS == ("digits", "word")
    assert answer_text(23) == "\\boxed{23}" and answer_value(23) == "23"
    assert answer_text(23, "word") == "\\boxed{ twentythree }" and answer_value(23, "word") == "twentythree"
    assert answer_tokens(31) == 6 and answer_tokens(31, "word") == answer_tokens(10, "word") == 5
    p = Problem(3, 7, 2)
    assert p.solution(2, answer_format="word") == "sOne three sTwo three \\boxed{ three }"
    assert p.solution(2) == "sOne three sTwo three \\boxed{3}" and p.answer(2, "word") == "three"


def test_an_unknown_format_is_refused_naming_the_field_and_the_formats():
    with pytest.raises(ValueError, match=r"ModChainSpec.answer_format must be one of digits, word, got 'roman'"):
        ModChainSpec(answer_format="roman")
    with pytest.raises(ValueError, match=r"answer_format must be one of digits, word, got 'Word'"):
        answer_text(3, "Word")


def test_the_word_box_holds_the_token_of_the_state_written_just_before():
    """Every demonstration with an answer ends ``sTwentyNine <x> \\ boxed { <x> } EOS`` with the two ``<x>`` one
    token id (a copy); the digits task's box holds other tokens (its lookup). The answer anchor of the key
    dropout (``answer_starts``) is that state in both."""
    words, digits = get_task("modchain31_wordbox_weak"), get_task("modchain31_weak")
    assert words.response_tokens == digits.response_tokens - 1 == 66
    tok = words.tokenizer()
    examples = words.sft_examples(tok)[:300]
    starts = words.answer_starts(tok, examples)
    answered = 0
    for (_, response), start in zip(examples, starts):
        if start == len(response):  # the weaker teacher's early stop (no answer)
            continue
        answered += 1
        state = response[start - 1]
        assert [tok.decode([t]) for t in response[start:start + 3]] == [" \\", "boxed", "{"]
        assert response[start + 3] == state and tok.decode(response[start + 4:]) == " }<|im_end|>"
        assert len(response) == words.response_tokens
    assert answered > 150
    tok_digits = digits.tokenizer()
    (_, response), = digits.sft_examples(tok_digits)[:1]
    start = digits.answer_starts(tok_digits, [(None, response)])[0]
    assert response[start - 1] not in response[start:]  # digits: no token of the box is the state's


def test_the_exact_reward_grades_the_word_box():
    record = get_task("modchain31_wordbox_weak").records("heldout", limit=1)[0]
    gold, x = record.answer, record.extra["solution"].split()[-4]
    assert gold == x and gold in (digit_word(d) for d in range(31))
    chain = record.extra["chain"]
    assert exact_verdict(f"{chain} \\boxed{{ {gold} }}", gold).reason == "correct"
    assert exact_verdict(f"{chain} \\boxed{{{gold}}}", gold).reason == "correct"  # surrounding spaces aside
    digits = str([d for d in range(31) if digit_word(d) == gold][0])
    assert exact_verdict(f"{chain} \\boxed{{ {digits} }}", gold).reason == "wrong"  # the old format is not the gold
    other = next(digit_word(d) for d in range(31) if digit_word(d) != gold)
    assert exact_verdict(f"{chain} \\boxed{{ {other} }}", gold).reason == "wrong"
    assert exact_verdict(f"{chain} \\boxed{{ {gold}", gold).reason == "no_answer"


def test_an_early_answer_is_boxed_in_the_tasks_format():
    import random

    teacher = EarlyStopTeacher(stop_step=2, stop_prob=1.0)
    p = next(Problem(x0, 1, 1) for x0 in range(10) if teacher.in_class(Problem(x0, 1, 1), 4))
    text = teacher.demonstration(p, 4, random.Random(0), answer_format="word")
    assert text.endswith(f"sTwo {digit_word(p.states(2)[-1])} \\boxed{{ {digit_word(p.states(2)[-1])} }}")
