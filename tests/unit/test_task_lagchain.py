"""``lagchain31_weak`` (tasks/lagchain.py): every step reads the response L steps back; its records, the shortcut
audit, the teacher, the tokenization and the warm start's examples."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.tasks import get_task
from sparse_rl_megatron.tasks.lagchain import LagChainSpec, LagChainTask, states
from sparse_rl_megatron.tasks.modchain_problems import number_word


@pytest.fixture(scope="module")
def task():
    return get_task("lagchain31_weak")


def test_each_state_is_its_registers_previous_value_plus_the_prompt_increment(task):
    spec = task.spec
    key = ((3, 30, 0, 7, 12, 5), 4, 9)
    xs = states(key, spec)
    assert xs[:6] == [3, 30, 0, 7, 12, 5] and len(xs) == spec.steps + 1
    for k in range(6, spec.steps + 1):
        assert xs[k] == (xs[k - 6] + (4 if k % 2 else 9)) % 31
    assert xs[29] == (5 + 4 * 4) % 31  # register 5 gains a at steps 11, 17, 23, 29


def test_records_carry_the_chain_the_class_and_the_teachers_demonstration(task):
    records = task.records("heldout", limit=50)
    assert records.records == task.records("heldout", limit=50).records  # deterministic
    for r in records:
        key = (tuple(r.extra["initial"]), r.extra["a"], r.extra["b"])
        xs = states(key, task.spec)
        words = r.extra["solution"].split()
        assert words[:4] == ["sZero", "v" + number_word(xs[0]), "sOne", "w" + number_word(xs[1])]
        assert words[-1] == f"\\boxed{{{xs[29]}}}" and r.answer == str(xs[29])
        assert r.extra["chain"] == " ".join(words[:-1])
        assert r.extra["subset"] == ("odd_x_stop" if xs[26] % 2 and xs[26] != xs[29] else "rest")
        shown = r.extra["demonstration"].split()
        assert shown == words or (r.extra["subset"] == "odd_x_stop" and shown == words[:2 * 27])  # stops, no answer
    train = task.records("train")
    assert len(train) == 3600 and not {r.source_id for r in train} & {r.source_id for r in task.records("heldout")}
    stopped = [r for r in train if r.extra["demonstration"] != r.extra["solution"]]
    weak = [r for r in train if r.extra["subset"] == "odd_x_stop"]
    assert 0.6 < len(stopped) / len(weak) < 0.8  # the teacher stops on 70% of its class


def test_it_passes_the_shortcut_audit(task):
    from sparse_rl_megatron.tasks.audit import audit_task

    audit = audit_task(task)
    assert audit.passed, "\n".join(audit.lines())


def test_every_word_is_one_token_and_the_response_fits_its_length(task):
    tok = task.tokenizer()
    record = task.records("heldout", limit=1)[0]
    assert len(tok(record.prompt, add_special_tokens=False)["input_ids"]) == task.prompt_tokens == 12
    ids = tok(" " + record.extra["solution"], add_special_tokens=False)["input_ids"]
    assert len(ids) + 1 <= task.response_tokens == 67  # EOS included
    examples, starts = task.sft_examples(tok)
    assert len(examples) == 3600
    for (_, response), start in zip(examples[:200], starts[:200]):
        if start == len(response):  # the teacher's early stop: no answer
            continue
        assert tok.decode(response[start:start + 2]).strip().startswith("\\boxed")
        assert tok.decode(response[start - 1]).strip()[1:] in {number_word(v) for v in range(31)}  # the state


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="lag must be in"):
        LagChainSpec(lag=7)
    with pytest.raises(ValueError, match="stop_step must be in"):
        LagChainSpec(stop_step=29)
    with pytest.raises(ValueError, match="split must be one of"):
        LagChainTask().records("test")
