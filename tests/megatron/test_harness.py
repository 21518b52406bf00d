"""The launch harness turns worker records into test outcomes: a failing rank's traceback, or "did not run"."""
import os

import pytest
import torch

from mcore_harness import LaunchResult
from mcore_worker import check_key, expect, mcore_check


def total(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x])
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.item()


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# Seeded failures, run by workers/w_failing_checks.py: "failing" under torchrun, "failing_alone" in one process.
@mcore_check(("failing", "failing_alone"))
def check_mismatch(ctx):
    """An ``expect`` fails between two collectives: the check runs to its end on every rank."""
    diff = total(0.5)  # a seeded defect: every rank sees a difference of 0.5 * world
    expect(diff <= 0.1, f"seeded mismatch {diff} > 0.1")
    expect(total(1.0) == world(), "the collective after the failed comparison ran on every rank")


@mcore_check(("failing", "failing_alone"))
def check_after_mismatch(ctx):
    assert total(1.0) == world()


@mcore_check("failing_alone")
def check_crash(ctx):
    raise RuntimeError("seeded crash")


@mcore_check("failing_alone")
def check_after_crash(ctx):
    pass


@mcore_check("failing_alone", params=[{"n": 1}, {"n": 2}])
def check_with_params(ctx, n):
    assert n == 1, f"seeded: n = {n}"


def result(records, nproc=2, code=1):
    return LaunchResult(nproc=nproc, returncode=code, output="...tail of the launch output", records=records)


def test_passes_only_when_every_rank_passed():
    a = check_key(check_after_crash, {})
    ok = {a: {0: {"status": "pass"}, 1: {"status": "pass"}}}
    result(ok, code=0).check(check_after_crash)
    with pytest.raises(pytest.fail.Exception, match=r"did not run on all 2 ranks \(ran on \[0\]\)"):
        result({a: {0: {"status": "pass"}}}).check(check_after_crash)


def test_failure_shows_the_rank_traceback():
    bad = {check_key(check_after_crash, {}): {0: {"status": "pass"},
                                              1: {"status": "fail", "traceback": "AssertionError: logits differ"}}}
    with pytest.raises(pytest.fail.Exception, match=r"failed on rank 1(.|\n)*AssertionError: logits differ"):
        result(bad).check(check_after_crash)


def test_missing_check_reports_the_output_tail():
    with pytest.raises(pytest.fail.Exception, match=r"exit code 1(.|\n)*tail of the launch output"):
        result({}).check(check_crash)


def test_a_check_is_named_by_its_function_and_parameters():
    """The record name comes from the function object and its parameters; a function that is no check, or a
    parameter set it does not run with, is an error of the test."""
    assert check_key(check_with_params, {"n": 2}) == "test_harness.check_with_params[n=2]"
    with pytest.raises(ValueError, match=r"no parameter set \{'n': 3\}"):
        result({}).check(check_with_params, n=3)
    with pytest.raises(TypeError, match="not a check"):
        result({}).check(test_a_check_is_named_by_its_function_and_parameters)


@pytest.mark.parametrize("nproc", [1, 2])
def test_one_failed_check_fails_its_own_test_only(tmp_path, nproc):
    """A real launch of a worker with seeded failures: the failed comparison is reported with its message on
    every rank, the checks after it run and pass; in one process an exception fails only its check. The
    traceback points into this file."""
    from mcore_harness import launch

    res = launch("w_failing_checks.py", nproc, ["failing_alone" if nproc == 1 else "failing"], tmp_path,
                 timeout=120)
    assert res.returncode != 0, "a worker with a failed check must exit non-zero"
    with pytest.raises(pytest.fail.Exception, match=r"failed on rank 0 \(of ranks \[0(, 1)?\]\)(.|\n)*"
                                                    r"expected: seeded mismatch"):
        res.check(check_mismatch)
    assert sorted(res.records[check_key(check_mismatch, {})]) == list(range(nproc))
    res.check(check_after_mismatch)
    if nproc == 1:
        with pytest.raises(pytest.fail.Exception, match=r'test_harness\.py", line \d+, in check_crash(.|\n)*'
                                                        "RuntimeError: seeded crash"):
            res.check(check_crash)
        res.check(check_after_crash)
        res.check(check_with_params, n=1)
        with pytest.raises(pytest.fail.Exception, match=r"AssertionError: seeded: n = 2"):
            res.check(check_with_params, n=2)
