"""The checkpoint-writer watch (``learner/save_children.py``) on real forked writers that follow megatron's protocol
(``write_preloaded_data``: put ``(index, results)``, then take a task from the count queue and mark it done) while
the saver waits as megatron's does (``count_queue.join()``, then one result per writer). A writer killed before it
reports is reported in its place; one killed after it marked its task done adds nothing; none is waited for."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest

from sparse_rl_megatron.learner.save_children import WriterDied, _RecordingContext, _report_dead_writers

WAIT_S = 60.0
"""Generous bound on the saver's wait (the watch polls every 0.2 s)."""


def _writer(local_proc_idx, results_queue, count_queue, fate):
    if fate == "killed before":
        os.kill(os.getpid(), signal.SIGKILL)
    results_queue.put((local_proc_idx, [f"wrote {local_proc_idx}"]))
    count_queue.get()
    count_queue.task_done()
    if fate == "killed after":
        results_queue.close()
        results_queue.join_thread()  # its result is in the pipe, as a writer that had time to exit
        os.kill(os.getpid(), signal.SIGKILL)


def _save(fates: list[str]) -> list:
    """Megatron's wait over writers with these fates, under the watch; returns the results in writer order and
    what the queue holds after them (a sentinel put once the watch stopped: anything before it was extra)."""
    ctx, writers, stop = multiprocessing.get_context("fork"), [], threading.Event()
    results, count = ctx.Queue(), ctx.JoinableQueue()
    recording = _RecordingContext(ctx, writers)
    procs = []
    for i, fate in enumerate(fates):
        count.put(i)
        procs.append(recording.Process(target=_writer, kwargs={"local_proc_idx": i, "results_queue": results,
                                                               "count_queue": count, "fate": fate}))
    assert len(writers) == len(fates) and set(writers[0][1]) == {"local_proc_idx", "results_queue", "count_queue"}
    watch = threading.Thread(target=_report_dead_writers, args=(writers, stop), daemon=True)
    watch.start()
    for p in procs:
        p.start()
    joined = threading.Thread(target=count.join, daemon=True)
    joined.start()
    joined.join(WAIT_S)
    try:
        assert not joined.is_alive(), "the saver still waits for its writers"
        got = dict(results.get(timeout=WAIT_S) for _ in fates)
    finally:
        stop.set()
        watch.join()
        for p in procs:
            p.join(WAIT_S)
    results.put("sentinel")
    return [got[i] for i in range(len(fates))] + [results.get(timeout=WAIT_S)]


def test_writers_that_all_report_are_left_alone():
    assert _save(["ok", "ok"]) == [["wrote 0"], ["wrote 1"], "sentinel"]


@pytest.mark.parametrize("fates", [["killed before", "ok", "ok"], ["ok", "killed before", "killed before"]])
def test_a_writer_killed_before_it_reports_is_reported_in_its_place(fates):
    out = _save(fates)
    assert out[-1] == "sentinel"
    for i, fate in enumerate(fates):
        if fate == "ok":
            assert out[i] == [f"wrote {i}"]
        else:
            assert isinstance(out[i], WriterDied)
            assert str(out[i]).startswith("checkpoint writer process ") and "(signal SIGKILL)" in str(out[i])


def test_a_writer_killed_after_it_marked_its_task_done_adds_nothing():
    assert _save(["killed after", "ok"]) == [["wrote 0"], ["wrote 1"], "sentinel"]
