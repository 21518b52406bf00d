"""The launch harness turns worker records into test outcomes: a failing rank's traceback, or "did not run"."""
import pytest

from mcore_harness import LaunchResult


def result(records, nproc=2, code=1):
    return LaunchResult(nproc=nproc, returncode=code, output="...tail of the launch output", records=records)


def test_passes_only_when_every_rank_passed():
    ok = {"a": {0: {"status": "pass"}, 1: {"status": "pass"}}}
    result(ok, code=0).check("a")
    with pytest.raises(pytest.fail.Exception, match=r"did not run on all 2 ranks \(ran on \[0\]\)"):
        result({"a": {0: {"status": "pass"}}}).check("a")


def test_failure_shows_the_rank_traceback():
    bad = {"a": {0: {"status": "pass"}, 1: {"status": "fail", "traceback": "AssertionError: logits differ"}}}
    with pytest.raises(pytest.fail.Exception, match=r"failed on rank 1(.|\n)*AssertionError: logits differ"):
        result(bad).check("a")


def test_missing_check_reports_the_output_tail():
    with pytest.raises(pytest.fail.Exception, match=r"exit code 1(.|\n)*tail of the launch output"):
        result({}).check("never_ran")
