"""The share of fully correct chains (``eval/subsets.py``): every intermediate state right, not just the answer."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.data.loader import Dataset
from sparse_rl_megatron.eval.subsets import full_chain, full_chain_fraction, full_chain_metrics
from sparse_rl_megatron.tasks import get_task


def _section(responses):
    return {"problems": [{"samples": [{"response": " " + text} for text in texts]} for texts in responses]}


def test_a_chain_counts_only_when_every_state_is_right():
    held = get_task("modchain31_weak").records("heldout", limit=3)
    r = held[0]
    words = r.extra["solution"].split()
    assert r.extra["chain"] == " ".join(words[:-1])  # the chain is the solution without its answer
    assert full_chain(" " + r.extra["solution"], r.extra["chain"])
    # one wrong state, the right answer boxed: the answer is right, the chain is not
    wrong = list(words)
    wrong[5] = "zero" if wrong[5] != "zero" else "one"
    assert not full_chain(" ".join(wrong), r.extra["chain"]) and wrong[-1] == words[-1]
    # stopped after step 26 (the weak teacher's demonstration of its class): not a full chain
    stopped = " ".join(words[:2 * 27]) + " \\boxed{3}"
    assert not full_chain(stopped, r.extra["chain"])
    assert not full_chain("", r.extra["chain"])

    ds = Dataset(name="x", path="x", records=held)
    # problem 0: 1 of 2 samples full; problem 1: none; problem 2: the only sample full
    section = _section([[held[0].extra["solution"], " ".join(wrong)], [stopped], [held[2].extra["solution"]]])
    assert full_chain_fraction(ds, section["problems"]) == (pytest.approx((0.5 + 0 + 1) / 3), 3)
    assert full_chain_metrics("eval/dense/x", ds, section) == {"eval/dense/x/full_chain_frac": pytest.approx(0.5)}
    with pytest.raises(ValueError, match="eval/dense/x: 2 evaluated problems for 3 records"):
        full_chain_metrics("eval/dense/x", ds, {"problems": section["problems"][:2]})


def test_records_without_a_chain_give_no_metric():
    from sparse_rl_megatron.data.record import MathRecord

    plain = [MathRecord(prompt="1+1?", answer="2", source_id="p0", dataset="x", answer_style="boxed")]
    ds = Dataset(name="x", path="x", records=plain)
    assert full_chain_fraction(ds, [{"samples": [{"response": "2"}]}]) is None
    assert full_chain_metrics("eval/dense/x", ds, {"problems": [{"samples": [{"response": "2"}]}]}) == {}
