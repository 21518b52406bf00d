"""The verifier worker process: receives (response, gold, style) tasks over a pipe, answers verdicts.

The in-worker (soft) time limit lives here: an interval timer raises ``_SoftTimeout`` in the middle of a
check, so the worker answers ``timeout`` and stays alive. The parent (``pool.py``) still kills a worker
that does not answer shortly after (a check stuck where Python signal handlers never run).
"""
from __future__ import annotations

import os
import signal

from sparse_rl_megatron.rewards.verify import Verdict


class _SoftTimeout(BaseException):
    """Raised by the worker's timer. A BaseException so that math-verify's ``except Exception`` lets it by."""


def worker_main(conn, soft_timeout_s: float | None, memory_limit_bytes: int | None) -> None:
    """Worker loop: receive ``(task_id, response, gold, style)``, send ``(task_id, verdict fields)``."""
    # Ctrl-C reaches the whole process group, and a job's cancellation (Slurm's scancel) sends SIGTERM to every
    # process of the job: the parent decides when its workers stop (it may still need their verdicts for the step
    # it finishes before saving); they also stop when it is gone (the pipe closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if memory_limit_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    from sparse_rl_megatron.rewards.verify import check_answer

    check_answer("\\boxed{1}", "1")  # warm math-verify's lazily compiled regexes before the clock matters
    state = {"armed": False, "fired": False}

    def on_alarm(signum, frame):
        if state["armed"]:
            state["armed"] = False
            state["fired"] = True
            raise _SoftTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if msg is None:
            return
        task_id, response, gold, style = msg
        state["fired"] = False
        verdict = None
        answer = safe_extract(response, style)  # linear-time string scan; reported even on a timeout
        if soft_timeout_s:
            state["armed"] = True
            signal.setitimer(signal.ITIMER_REAL, soft_timeout_s)
        try:
            try:
                verdict = check_answer(response, gold, style)
            finally:
                # disarm BEFORE any handler below runs: a timer firing inside a handler (str() of a huge
                # sympy exception, say) would raise out of it and kill the worker (a wrong parse_error verdict)
                state["armed"] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftTimeout:
            pass
        except MemoryError:
            verdict = Verdict(0.0, "timeout", answer, "ran out of memory (worker memory cap)")
        except BaseException as exc:  # noqa: BLE001 - report, never die on one answer
            verdict = Verdict(0.0, "parse_error", answer, f"{type(exc).__name__}: {str(exc)[:200]}")
        if state["fired"] or verdict is None:  # also when something swallowed our exception
            verdict = Verdict(0.0, "timeout", answer, f"no verdict within {soft_timeout_s:g} s")
        conn.send((task_id, (verdict.reward, verdict.reason, verdict.answer, verdict.detail)))


def safe_extract(response: str, style: str) -> str | None:
    from sparse_rl_megatron.rewards.extract import extract_answer

    try:
        return extract_answer(response, style)
    except Exception:  # noqa: BLE001 - a bad style is reported by check_answer itself
        return None
