"""Final-answer extraction: last \\boxed{} with nested braces, \\fbox, trailing numbers, GSM8K gold lines."""
import pytest

from sparse_rl_megatron.rewards.extract import (
    extract_answer, gsm8k_gold, last_boxed, trailing_number,
)


@pytest.mark.parametrize("text, expected", [
    (r"so $\boxed{5}$.", "5"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\boxed{ {a}^{ {b} } }", "{a}^{ {b} }"),
    (r"answer \fbox{7}", "7"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),          # escaped braces are literal characters
    (r"\boxed{\}}", r"\}"),
    (r"the answer is \boxed 5 and done", "5"),  # the unbraced form
    (r"\boxed{3} but then \boxed{\frac{1}{", "3"),  # a truncated last box is not an answer
    (r"no box here", None),
    (r"\boxed{4", None),
    (r"\boxedfoo{4}", None),                    # another command, not \boxed
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("She makes 9 * 2 = $18 every day.", "18"),
    ("so 1,250 apples", "1250"),
    ("the total is -3.5.", "-3.5"),
    ("it costs .75 dollars", ".75"),
    ("x2 and y3", None),                         # digits glued to a word are not numbers
    ("no digits", None),
])
def test_trailing_number(text, expected):
    assert trailing_number(text) == expected


def test_gsm8k_gold():
    assert gsm8k_gold("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == "18"
    assert gsm8k_gold("...\n#### 1,000") == "1000"
    assert gsm8k_gold("...\n#### $5") == "5"
    assert gsm8k_gold("no final line 7") is None


def test_extract_answer_styles():
    assert extract_answer("The answer is 42.", "boxed") is None
    assert extract_answer("The answer is 42.", "boxed_or_number") == "42"
    assert extract_answer(r"so \boxed{41}, not 42", "boxed_or_number") == "41"   # a box wins
    assert extract_answer("7 apples\n#### 12\nthat is 13", "boxed_or_number") == "12"  # #### beats last number
    with pytest.raises(ValueError, match="boxed_or_number"):
        extract_answer("x", "last_line")
