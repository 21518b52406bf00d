"""The verifier pool: order, reasons, time limits (soft and hard), dead workers, bad input; never hangs."""
import os
import signal
import threading
import time

import pytest

from sparse_rl_megatron.rewards import MathReward, VerifierPool, VerifierPoolConfig, reason_counts

# Pathological answers: each makes math-verify/sympy run far past a 1 s limit (minutes, measured).
TOWER = r"\boxed{9^{9^{9^{9}}}}"
BIG_POLY = r"\boxed{(x+1)^{2000}}"
DEEP_NESTING = r"\boxed{" + "(" * 300 + "1" + ")" * 300 + "}"
HUGE_SUM = r"\boxed{" + "+".join(f"x^{{{i}}}" for i in range(3000)) + "}"
GOOD = [(r"so \boxed{\frac{1}{2}}", "0.5", "boxed"), (r"\boxed{3}", "3", "boxed"), ("it is 18.", "18", "boxed_or_number")]


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(VerifierPoolConfig(num_workers=2, timeout_s=1.0)) as p:
        yield p


@pytest.mark.timeout(60)
def test_mixed_batch_keeps_order_and_reasons(pool):
    tasks = [
        (r"\boxed{0.5}", r"\frac12", "boxed"),
        (r"\boxed{7}", "8", "boxed"),
        ("no final answer", "8", "boxed"),
        (r"\boxed{2+}", "2", "boxed"),
        ("The total is 1,250 dollars.", "1250", "boxed_or_number"),
    ]
    verdicts = pool.check(tasks)
    assert [v.reason for v in verdicts] == ["correct", "wrong", "no_answer", "parse_error", "correct"]
    assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert pool.check([]) == []


@pytest.mark.timeout(90)
def test_pathological_answers_time_out_and_pool_keeps_working(pool):
    before = pool.timeouts
    tasks = [(TOWER, "2", "boxed"), GOOD[0], (BIG_POLY, "2", "boxed"), (DEEP_NESTING, "1", "boxed"),
             GOOD[1], (HUGE_SUM, "2", "boxed"), GOOD[2]]
    verdicts = pool.check(tasks)
    assert [v.reason for v in verdicts] == ["timeout", "correct", "timeout", "timeout", "correct", "timeout",
                                            "correct"]
    assert verdicts[0].answer == "9^{9^{9^{9}}}"  # the answer found is reported even on a timeout
    assert pool.timeouts - before == 4
    assert [v.reason for v in pool.check(GOOD)] == ["correct"] * 3


@pytest.mark.timeout(90)
def test_hung_worker_is_killed_and_replaced():
    # Without the in-worker timer, only the parent's kill can end a stuck check: the worker must be
    # replaced (not waited on) and the other tasks must still be answered.
    config = VerifierPoolConfig(num_workers=2, timeout_s=1.0, soft_timeout=False)
    with VerifierPool(config) as pool:
        verdicts = pool.check([(TOWER, "2", "boxed"), *GOOD, (BIG_POLY, "2", "boxed"), *GOOD])
        assert [v.reason for v in verdicts] == ["timeout"] + ["correct"] * 3 + ["timeout"] + ["correct"] * 3
        assert "killed" in verdicts[0].detail
        assert pool.restarts == 2
        assert [v.reason for v in pool.check(GOOD)] == ["correct"] * 3


@pytest.mark.timeout(90)
def test_worker_that_dies_mid_check_gives_parse_error_and_is_replaced():
    with VerifierPool(VerifierPoolConfig(num_workers=1, timeout_s=30.0)) as pool:
        def kill_busy_worker():
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                pids = pool.busy_worker_pids()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_busy_worker)
        killer.start()
        verdicts = pool.check([(TOWER, "2", "boxed"), GOOD[1]])
        killer.join()
        assert verdicts[0].reason == "parse_error" and "died" in verdicts[0].detail
        assert verdicts[1].reason == "correct"
        assert pool.restarts == 1


@pytest.mark.timeout(60)
def test_workers_run_under_the_memory_cap():
    # The cap is what keeps one huge answer from taking the machine's RAM: check the kernel applies it.
    with VerifierPool(VerifierPoolConfig(num_workers=1, timeout_s=3.0, memory_limit_gb=0.5)) as pool:
        box = {}

        def read_limit():
            while "limit" not in box:
                for pid in pool.busy_worker_pids():
                    with open(f"/proc/{pid}/limits") as f:
                        box["limit"] = next(line for line in f if line.startswith("Max address space"))
                time.sleep(0.02)

        reader = threading.Thread(target=read_limit, daemon=True)
        reader.start()
        pool.check([(BIG_POLY, "2", "boxed")])  # busy long enough for the reader
        reader.join(timeout=10)
    assert box["limit"].split()[3:5] == [str(2**29), str(2**29)]


def test_bad_config_and_tasks_are_rejected(pool):
    with pytest.raises(ValueError, match="num_workers"):
        VerifierPoolConfig(num_workers=0)
    with pytest.raises(ValueError, match="forkserver"):
        VerifierPoolConfig(start_method="thread")
    with pytest.raises(ValueError, match="boxed_or_number"):
        pool.check([("x", "1", "last_line")])


@pytest.mark.timeout(60)
def test_math_reward_sets_sample_fields():
    import torch

    from sparse_rl_megatron.rollout.sample import Sample

    def sample(text, gold, style="boxed"):
        return Sample(prompt_ids=[1], response_ids=[2, 3], sampler_logprobs=torch.zeros(2), response_text=text,
                      metadata={"gold_answer": gold, "answer_style": style})

    samples = [sample(r"\boxed{\frac{3}{6}}", "0.5"), sample("so 12", "13", "boxed_or_number"), sample("?", "1")]
    with MathReward(VerifierPoolConfig(num_workers=1, timeout_s=5.0)) as reward:
        verdicts = reward.score_samples(samples)
        with pytest.raises(ValueError, match="gold_answer"):
            reward.score_samples([Sample(prompt_ids=[1], response_ids=[], sampler_logprobs=torch.zeros(0))])
    assert [(s.reward, s.reward_reason) for s in samples] == [(1.0, "correct"), (0.0, "wrong"), (0.0, "no_answer")]
    assert samples[0].metadata["extracted_answer"] == r"\frac{3}{6}"
    assert reason_counts(verdicts) == {"correct": 1, "wrong": 1, "no_answer": 1, "timeout": 0, "parse_error": 0}


def test_worker_timer_is_disarmed_before_error_handling(monkeypatch):
    # The worker loop, run here in the main thread (the interval timer needs it): a check that raises an
    # exception whose text is slow to build must still give a parse_error verdict, not let the timer fire
    # inside the handler and kill the worker.
    from multiprocessing import Pipe

    from sparse_rl_megatron.rewards import verify, worker

    class SlowText(Exception):
        def __str__(self):
            time.sleep(1.0)  # longer than the 0.3 s soft limit below
            return "slow"

    real = verify.check_answer

    def fake_check(response, gold, style="boxed"):
        if response == "raise":
            raise SlowText()
        return real(response, gold, style)

    monkeypatch.setattr(verify, "check_answer", fake_check)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}  # worker_main's
    parent, child = Pipe()
    parent.send((7, "raise", "1", "boxed"))
    parent.send(None)
    try:
        worker.worker_main(child, 0.3, None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in handlers.items():
            signal.signal(s, h)
    assert parent.recv() == ("ready", os.getpid())
    task_id, (reward, reason, _, detail) = parent.recv()
    assert (task_id, reward, reason, detail) == (7, 0.0, "parse_error", "SlowText: slow")
