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


@pytest.mark.parametrize("nproc", [1, 2])
def test_one_failed_check_fails_its_own_test_only(tmp_path, nproc):
    """A real launch of a worker with seeded failures: the failed comparison is reported with its message on
    every rank, the checks after it run and pass; in one process an exception fails only its check."""
    from mcore_harness import launch

    res = launch("w_failing_checks.py", nproc, [], tmp_path, timeout=120)
    assert res.returncode != 0, "a worker with a failed check must exit non-zero"
    with pytest.raises(pytest.fail.Exception, match=r"failed on rank 0 \(of ranks \[0(, 1)?\]\)(.|\n)*"
                                                    r"expected: seeded mismatch"):
        res.check("mismatch")
    assert sorted(res.records["mismatch"]) == list(range(nproc))
    res.check("after_mismatch")
    if nproc == 1:
        with pytest.raises(pytest.fail.Exception, match="RuntimeError: seeded crash"):
            res.check("crash")
        res.check("after_crash")
