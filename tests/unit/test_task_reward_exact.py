"""The ``exact`` reward: final answer found by answer style, compared as a string with the gold answer."""
import pytest
import torch

from sparse_rl_megatron.rewards.exact import ExactReward, exact_verdict
from sparse_rl_megatron.rewards.registry import REWARDS
from sparse_rl_megatron.rollout.sample import Sample
from sparse_rl_megatron.tasks import get_task


def _sample(text: str, record) -> Sample:
    s = Sample(prompt_ids=[1], response_ids=[2, 3], sampler_logprobs=torch.zeros(2), response_text=text)
    s.metadata.update(record.metadata())
    return s


def test_worked_solution_scores_one_and_a_wrong_one_zero():
    task = get_task("modchain")
    records = list(task.records("heldout", limit=3))
    worked = [_sample(" " + r.extra["solution"], r) for r in records]
    wrong_digit = str((int(records[0].answer) + 1) % 10)
    wrong = _sample(" " + records[0].extra["solution"].rsplit("\\boxed", 1)[0] + f"\\boxed{{{wrong_digit}}}", records[0])
    unfinished = _sample(" " + records[1].extra["solution"].rsplit(" ", 1)[0], records[1])  # no final answer
    with REWARDS.get(task.reward)() as reward:
        verdicts = reward.score_samples(worked + [wrong, unfinished])
    assert [v.reward for v in verdicts] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert [v.reason for v in verdicts] == ["correct"] * 3 + ["wrong", "no_answer"]
    assert [s.reward for s in worked] == [1.0] * 3 and wrong.reward_reason == "wrong"
    assert worked[0].metadata["extracted_answer"] == records[0].answer
    assert wrong.metadata["extracted_answer"] == wrong_digit and unfinished.metadata["extracted_answer"] is None


@pytest.mark.parametrize("response, gold, style, expected", [
    ("so \\boxed{ 7 }", "7", "boxed", "correct"),         # whitespace around the answer
    ("so \\boxed{7}", "$7$", "boxed", "correct"),         # $ delimiters of a gold field
    ("\\boxed{3} then \\boxed{7}", "7", "boxed", "correct"),  # the last box counts
    ("so \\boxed{07}", "7", "boxed", "wrong"),            # exact: no numeric equivalence
    ("so \\boxed{0.5}", "\\frac{1}{2}", "boxed", "wrong"),
    ("the answer is 7", "7", "boxed", "no_answer"),
    ("the answer is 7", "7", "boxed_or_number", "correct"),
    ("\\boxed{}", "7", "boxed", "no_answer"),
])
def test_exact_verdicts(response, gold, style, expected):
    assert exact_verdict(response, gold, style).reason == expected


def test_score_checks_lengths_and_samples_need_a_gold_answer():
    reward = ExactReward()
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        reward.score(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="2 responses but 3 answer styles"):
        reward.score(["a", "b"], ["1", "2"], ["boxed"] * 3)
    bare = Sample(prompt_ids=[1], response_ids=[2], sampler_logprobs=torch.zeros(1), response_text="\\boxed{1}")
    with pytest.raises(ValueError, match="no metadata\\['gold_answer'\\]"):
        reward.score_samples([bare])
