"""The last line of a run whose recipe documents its result (trainer/runtime/expected_result.py)."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.trainer.config import ExpectConfig
from sparse_rl_megatron.trainer.runtime.expected_result import expected_result_line, overridden_keys

RANGES = {"eval/dense/shortcut_free_accuracy": [0.9, 1.0], "eval/sparse/shortcut_free_accuracy": [0.85, 1.0]}


def test_the_line_says_inside_or_outside_for_each_metric_at_the_documented_step():
    expect = ExpectConfig(step=150, ranges=RANGES, source="docs/embedded-default.md, seeds 0-7 x 2 kernel paths")
    records = [{"step": 0, "eval/dense/shortcut_free_accuracy": 0.5, "eval/sparse/shortcut_free_accuracy": 0.5},
               {"step": 150, "eval/dense/shortcut_free_accuracy": 0.997, "eval/sparse/shortcut_free_accuracy": 0.8}]
    line = expected_result_line(expect, records)
    assert line == ("documented result (docs/embedded-default.md, seeds 0-7 x 2 kernel paths) at step 150: "
                    "eval/dense/shortcut_free_accuracy 0.997 in [0.900, 1.000]; "
                    "eval/sparse/shortcut_free_accuracy 0.800 OUTSIDE [0.850, 1.000]: OUTSIDE the documented range")
    records[1]["eval/sparse/shortcut_free_accuracy"] = 0.85
    assert expected_result_line(expect, records).endswith(": inside the documented range")
    expect.overridden = ["steps", "rollout.compression.budget"]
    assert expected_result_line(expect, records).endswith(
        "inside the documented range (the range is the recipe's as written; this run changed steps, "
        "rollout.compression.budget)")
    assert "did not evaluate" in expected_result_line(expect, records[:1])
    assert expected_result_line(ExpectConfig(), records) is None and expected_result_line(None, records) is None


def test_only_keys_that_change_the_experiment_count_as_overridden():
    assert overridden_keys(["seed=3", "run_dir=/tmp/x", "log.progress=false", "checkpoint.keep_last=1",
                            "expect.step=150"]) == []
    assert overridden_keys(["steps=200", "seed=1", "rollout.compression.budget=16", "seeds=2"]) == [
        "steps", "rollout.compression.budget", "seeds"]


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError, match=r"ranges\['x'\] must be \[low, high\]"):
        ExpectConfig(step=1, ranges={"x": [1.0, 0.5]})
    with pytest.raises(ValueError, match="step must name the evaluation step"):
        ExpectConfig(ranges={"x": [0.0, 1.0]})
