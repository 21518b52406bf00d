"""``rollout/repetition_rate``: the repeated-n-gram fraction of responses, exact on hand-made token lists."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparse_rl_megatron.rollout.repetition import repeated_ngram_frac, repetition_metrics


def test_a_response_without_repeats_scores_zero_and_a_loop_scores_its_repeated_share():
    assert repeated_ngram_frac([1, 2, 3, 4, 5, 6]) == 0.0
    # modchain-like: step markers make every 4-gram new even when the state cycles
    assert repeated_ngram_frac([101, 3, 102, 3, 103, 3, 104, 3]) == 0.0
    # 1 2 1 2 1 2 1 2: 5 4-grams, (1 2 1 2) and (2 1 2 1) new, the other 3 repeat
    assert repeated_ngram_frac([1, 2] * 4) == pytest.approx(3 / 5)
    assert repeated_ngram_frac([7] * 10, n=2) == pytest.approx(8 / 9)


def test_shorter_than_n_scores_zero_and_the_metric_averages_samples():
    assert repeated_ngram_frac([1, 2, 3]) == 0.0
    samples = [SimpleNamespace(response_ids=[1, 2] * 4), SimpleNamespace(response_ids=[1, 2, 3, 4])]
    assert repetition_metrics(samples) == {"rollout/repetition_rate": pytest.approx(0.3)}
    assert repetition_metrics([]) == {}
