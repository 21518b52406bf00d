"""``lagchain31_var_tags_weak`` (tasks/lagchain.py with ``register_letters = INITIAL_LETTERS``): register i's states
are written with the letter of x_i's prompt tag, so restating x_i writes the tag's own token and a step's read (its
register's last value, 2L - 1 positions back) is a token the prompt's family shares; problems, increments and the
teacher as ``lagchain31_var_weak``'s, its own split."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.tasks import get_task
from sparse_rl_megatron.tasks.lagchain import (
    INITIAL_LETTERS, REGISTER_LETTERS, LagChainSpec, read_offset, record_key, states,
)
from sparse_rl_megatron.tasks.modchain_problems import number_word, parse_prompt


@pytest.fixture(scope="module")
def task():
    return get_task("lagchain31_var_tags_weak")


def test_register_i_is_written_with_x_i_tags_letter_and_restating_copies_the_tag(task):
    for r in task.records("heldout", limit=100):
        lag = len(r.extra["initial"])
        xs = states(record_key(r), task.spec)
        solution = r.extra["solution"].split()
        assert solution[1:60:2] == [INITIAL_LETTERS[k % lag] + number_word(x) for k, x in enumerate(xs)]
        prompt_words = r.prompt.split()
        assert all(solution[2 * i + 1] in prompt_words for i in range(lag))  # x_i restated as its tag, word for word
        assert solution[-1] == f"\\boxed{{{xs[29]}}}" and r.answer == str(xs[29])
        assert r.extra["shortcut_free"] == all(str(v) != r.answer for _, v in parse_prompt(r.prompt))
    assert task.spec.lags == (2, 3, 4, 5, 6) and task.spec.warm_check is not None


def test_the_read_is_the_same_token_family_2L_minus_1_back_and_the_warm_start_spares_it(task):
    tok = task.tokenizer()
    examples, _ = task.sft_examples(tok)
    offsets = task.sft_read_offsets()
    records = task.records("train")
    for (prompt, response), (offset,), r in list(zip(examples, offsets, records))[:200]:
        lag = len(r.extra["initial"])
        assert offset == read_offset(lag) == 2 * lag - 1
        xs = states(record_key(r), task.spec)
        restated = [response[2 * i + 1] for i in range(lag)]
        assert all(t in prompt for t in restated)  # the prompt tag's token id itself
        steps = (len(response) - 1) // 2 if len(response) < task.response_tokens else 30
        for k in range(lag, min(steps, 30)):
            query = 2 * k  # the step word, whose next token is state k
            read = tok.decode([response[query - offset]]).strip()
            assert read == INITIAL_LETTERS[k % lag] + number_word(xs[k - lag])


def test_its_tokenizer_has_no_state_tokens_of_its_own_and_every_word_is_one_token(task):
    tok = task.tokenizer()
    vocab = tok.get_vocab()
    assert not any(w.lstrip("Ġ▁ ").startswith(tuple(REGISTER_LETTERS)) and len(w.lstrip("Ġ▁ ")) > 1
                   and w.lstrip("Ġ▁ ")[1:2].isupper() for w in vocab)
    assert len(tok) < len(get_task("lagchain31_var_weak").tokenizer())
    for r in task.records("heldout", limit=20):
        text = f"{r.prompt} {r.extra['chain']}"  # the box is answer_tokens, as every digits box
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == len(text.split())
    assert task.prompt_tokens == 13 and task.response_tokens == 67


def test_it_passes_the_shortcut_audit(task):
    from sparse_rl_megatron.tasks.audit import audit_task

    audit = audit_task(task)
    assert audit.passed, "\n".join(audit.lines())


def test_other_register_letters_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="LagChainSpec.register_letters must be 'vwxyzj'.*'cdefgh'.*got 'abcdef'"):
        LagChainSpec(register_letters="abcdef")


def test_a_register_marker_names_the_register_before_its_state_and_the_read_is_3L_minus_1_back(task):
    from dataclasses import replace

    from sparse_rl_megatron.tasks.lagchain import LagChainTask

    marked = LagChainTask(replace(task.spec, register_marker=True), name=task.name)
    assert marked.response_tokens == 97 and marked.spec.tokens_per_step == 3
    tok = marked.tokenizer()
    examples, _ = marked.sft_examples(tok)
    records = marked.records("train")
    for (_, response), keep, r in list(zip(examples, marked.sft_read_offsets(), records))[:100]:
        lag = len(r.extra["initial"])
        assert keep == (3 * lag - 1, 3 * lag)
        words = [tok.decode([t]).strip() for t in response]
        xs = states(record_key(r), marked.spec)
        for k in range(lag, min(30, len(words) // 3)):
            marker = 3 * k + 1  # the query of state k: its register's letter, just written
            letter = INITIAL_LETTERS[k % lag]
            assert words[marker] == letter and words[marker + 1] == letter + number_word(xs[k])
            assert words[marker - keep[1]] == letter  # the same marker, L steps back
            assert words[marker - keep[0]] == letter + number_word(xs[k - lag])  # the value it reads
    with pytest.raises(ValueError, match="register_marker and register_tokens are two ways"):
        LagChainSpec(register_marker=True, register_tokens=True)


def test_the_marker_task_is_registered_and_passes_the_audit():
    from sparse_rl_megatron.tasks.audit import audit_task

    marked = get_task("lagchain31_var_marker_weak")
    assert marked.spec.register_marker and marked.spec.register_letters == INITIAL_LETTERS
    assert marked.response_tokens == 97 and marked.spec.warm_start_steps == 3000
    words = marked.records("heldout", limit=1).records[0].extra["chain"].split()
    assert words[:3] == ["sZero", "c", words[2]] and words[2].startswith("c")
    audit = audit_task(marked)
    assert audit.passed, "\n".join(audit.lines())
