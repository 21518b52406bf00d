"""An engine's calls on their own thread (``trainer/engine_pool/worker.py``): results and errors come back, a hung
call is given up at its deadline (and the engine takes no more calls), and a weight stream is handed over one
item at a time, each finished before the next is given."""
from __future__ import annotations

import threading
import time

import pytest

from sparse_rl_megatron.trainer.engine_pool.worker import EngineHang, EngineWorker, Handoff

GENEROUS_S = 30.0  # a bound that a working call never comes near, even on a loaded machine


def test_results_and_errors_come_back_and_a_hang_is_given_up_at_the_deadline():
    worker = EngineWorker("engine #0 on rank 0")
    assert worker.call(lambda: 41 + 1, "adding", time.monotonic() + GENEROUS_S) == 42
    with pytest.raises(ConnectionError, match="gone"):
        worker.call(lambda: (_ for _ in ()).throw(ConnectionError("gone")), "failing", time.monotonic() + GENEROUS_S)
    stuck = threading.Event()
    with pytest.raises(EngineHang, match="no answer generating step 3 within the phase deadline"):
        worker.call(stuck.wait, "generating step 3", time.monotonic() + 0.2)
    with pytest.raises(EngineHang, match=r"stuck in an earlier call \(generating step 3\)"):
        worker.call(lambda: 1, "probing", time.monotonic() + GENEROUS_S)
    stuck.set()
    worker.close()


def test_a_stream_is_handed_over_one_item_at_a_time():
    worker, handoff, log = EngineWorker("e"), Handoff(), []

    def engine_load(items):
        for item in items:
            log.append(f"start {item}")
            time.sleep(0.01)  # the engine works on the item; the feeder must wait for it
            log.append(f"done {item}")
        return "loaded"

    future = worker.submit(lambda: engine_load(handoff.items()), "loading")
    deadline = time.monotonic() + GENEROUS_S
    for item in range(3):
        assert handoff.give(item, future, deadline)
        log.append(f"given {item}")  # give returned: the engine has finished the item
    handoff.close(future, deadline)
    assert worker.wait(future, "loading", deadline) == "loaded"
    assert log == [x for i in range(3) for x in (f"start {i}", f"done {i}", f"given {i}")]


def test_an_engine_that_fails_or_hangs_mid_stream_stops_the_feed_without_blocking_it():
    worker, handoff = EngineWorker("e"), Handoff()

    def engine_load(items):
        for item in items:
            if item == 1:
                raise RuntimeError("bad bucket")

    future = worker.submit(lambda: engine_load(handoff.items()), "loading")
    deadline = time.monotonic() + GENEROUS_S
    assert handoff.give(0, future, deadline) and not handoff.give(1, future, deadline)
    assert not handoff.give(2, future, deadline)  # stopped reading: the feeder goes on without it
    with pytest.raises(RuntimeError, match="bad bucket"):
        worker.wait(future, "loading", deadline)

    hung, handoff, stuck = EngineWorker("h"), Handoff(), threading.Event()

    def hang_on_first(items):
        for _ in items:
            stuck.wait()

    future = hung.submit(lambda: hang_on_first(handoff.items()), "loading")
    t0 = time.monotonic()
    assert not handoff.give(0, future, t0 + 0.3)
    assert time.monotonic() - t0 < GENEROUS_S
    with pytest.raises(EngineHang):
        hung.wait(future, "loading", t0 + 0.3)
    stuck.set()
