"""math-verify equivalence (gold first), known-wrong answers and malformed outputs, checked in-process."""
import pytest

from sparse_rl_megatron.rewards.verify import Verdict, check_answer, normalize_gold


@pytest.mark.parametrize("answer, gold", [
    (r"0.5", r"\frac{1}{2}"),        # decimal vs fraction
    (r"\frac12", r"\frac{1}{2}"),    # brace-less \frac
    (r"1/2", r"\frac12"),
    (r"\dfrac{3}{4}", "0.75"),
    (r"0.1", r"10\%"),               # percent
    (r"10\%", "0.1"),
    (r"\{2, 1\}", r"\{1, 2\}"),      # sets: order does not matter
    (r"3, 1, 2", r"1, 2, 3"),
    (r"\sqrt{18}", r"3\sqrt{2}"),
    (r"(x+1)^2", r"x^2+2x+1"),
    (r"x = 2", "2"),
    (r"\$18", "18"),
    (r"18 \text{ apples}", "18"),
    (r"\text{Evelyn}", r"\text{Evelyn}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \frac{\pi}{2})"),
    (r"[1, 2)", r"[1,2)"),
])
def test_equivalent_forms_score_one(answer, gold):
    v = check_answer(f"Reasoning ... so the answer is $\\boxed{{{answer}}}$.", gold)
    assert (v.reward, v.reason) == (1.0, "correct"), v


@pytest.mark.parametrize("answer, gold", [
    ("6", "5"),
    (r"\frac{1}{3}", "0.33"),        # not within rounding
    ("0.33", r"\frac{1}{3}"),
    (r"\{1, 3\}", r"\{1, 2\}"),
    (r"[1, 2]", r"[1, 2)"),
    (r"60^\circ", r"\frac{\pi}{3}"),
    (r"-18", "18"),
    (r"x^2 - 1", r"(x+1)^2"),
    (r"\text{west}", r"\text{east}"),
])
def test_known_wrong_answers_score_zero(answer, gold):
    v = check_answer(f"so \\boxed{{{answer}}}", gold)
    assert (v.reward, v.reason) == (0.0, "wrong"), v


def test_gsm8k_style_trailing_number():
    assert check_answer("9 * 2 = 18, so she makes $18.", "18", "boxed_or_number").reason == "correct"
    assert check_answer("9 * 2 = 18, so she makes $19.", "18", "boxed_or_number").reason == "wrong"
    # The same response under the MATH style has no answer: only a box counts there.
    assert check_answer("so she makes $18.", "18", "boxed").reason == "no_answer"


@pytest.mark.parametrize("response", ["I don't know.", r"\boxed{ }", r"truncated \boxed{\frac{1}{"])
def test_no_answer(response):
    v = check_answer(response, "2")
    assert (v.reward, v.reason) == (0.0, "no_answer"), v


@pytest.mark.parametrize("answer", [r"\frac{1}{}", "2+", "x=", r"\begin{pmatrix}", "?"])
def test_malformed_answer_is_parse_error(answer):
    v = check_answer(f"\\boxed{{{answer}}}", "2")
    assert (v.reward, v.reason, v.answer) == (0.0, "parse_error", answer), v


def test_gold_is_passed_first():
    # math-verify is not symmetric: an interval answer matches a relation gold ("1 < x < 2"), but a
    # relation answer does not match an interval gold. Swapping gold and answer would flip both.
    assert check_answer(r"\boxed{(1,2)}", r"1 < x < 2").reason == "correct"
    assert check_answer(r"\boxed{1 < x < 2}", r"(1,2)").reason == "wrong"


def test_gold_delimiters_are_normalised():
    # Gold delimiters as published ("$221$, $8$" in OlympiadBench) are stripped; an escaped \$ stays.
    assert normalize_gold("$221$, $8$") == "221, 8"
    assert normalize_gold(r"\$18.90") == r"\$18.90"
    assert check_answer(r"\boxed{8, 221}", "$221$, $8$").reason == "correct"


def test_verdict_rejects_unknown_reason():
    with pytest.raises(ValueError, match="no_answer"):
        Verdict(0.0, "crashed")
