"""An engine's calls run on a thread of their own, so a rank can stop waiting for a hung engine.

The rank's main thread keeps the learner's collectives and the exchanges with the other ranks; every call into
the rollout engine (generate, weight update, probe, memory release) goes to this engine's daemon thread and is
waited for at most until the phase deadline. A call that misses it raises ``EngineHang`` on the main thread
(the rank then reports it to every rank and exits; the stuck thread dies with the process, and the engine's own
processes are stopped by its ``shutdown``). After a hang the engine takes no further calls.

``Handoff`` feeds a lazy stream (the learner's weight buckets) from the main thread to a call on the engine's
thread one item at a time: ``give`` returns once the engine asked for the next item, i.e. has finished with this
one, so one bucket is alive at a time and the main thread keeps iterating the learner's export (a collective)
whatever the engine does.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")
_END = object()


class EngineHang(RuntimeError):
    """An engine call did not finish within its deadline."""


class EngineWorker:
    """A daemon thread that runs one engine's calls in order (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self._calls: queue.Queue = queue.Queue()
        self.hung: str | None = None
        """What hung (set once a call missed its deadline; later calls fail at once)."""
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._calls.get()
            if fn is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as err:  # handed to the waiting main thread
                future.set_exception(err)

    def submit(self, fn: Callable[[], T], what: str) -> Future:
        if self.hung is not None:
            raise EngineHang(f"{self.name} is stuck in an earlier call ({self.hung}); it takes no more calls")
        future: Future = Future()
        self._calls.put((fn, future))
        return future

    def wait(self, future: Future, what: str, deadline: float) -> Any:
        """The call's result (or its error) once it finishes; ``EngineHang`` at ``deadline`` (time.monotonic)."""
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self.hung = what
            raise EngineHang(f"no answer {what} within the phase deadline") from None

    def call(self, fn: Callable[[], T], what: str, deadline: float) -> T:
        """Run ``fn`` on the engine's thread; wait until ``deadline`` at most."""
        return self.wait(self.submit(fn, what), what, deadline)

    def close(self) -> None:
        """Let the thread end after its current call (a hung call keeps it; it is a daemon)."""
        self._calls.put((None, None))


class Handoff:
    """A stream handed from the main thread to a call on the engine's thread, one item at a time."""

    def __init__(self):
        self._items: queue.Queue = queue.Queue(maxsize=1)
        self._asked = threading.Semaphore(0)
        self._done = threading.Event()

    def items(self) -> Iterator[Any]:
        """The engine's side: the items, in order (ends when the main thread closes the stream)."""
        try:
            while True:
                self._asked.release()
                item = self._items.get()
                if item is _END:
                    return
                yield item
        finally:
            self._done.set()

    def give(self, item: Any, future: Future, deadline: float) -> bool:
        """Hand ``item`` over and wait until the engine is done with it; False if the call ended (it stopped
        reading: an error, or it needed no more) or the deadline passed (the caller then treats it as hung)."""
        if not self._wait_asked(future, deadline):
            return False
        self._items.put(item)
        return self._wait_asked(future, deadline, release=True)

    def close(self, future: Future, deadline: float) -> None:
        """End the stream (the engine's ``for`` loop finishes)."""
        if self._wait_asked(future, deadline):
            self._items.put(_END)

    def _wait_asked(self, future: Future, deadline: float, release: bool = False) -> bool:
        while not self._asked.acquire(timeout=0.05):
            if future.done() or self._done.is_set() or time.monotonic() >= deadline:
                return False
        if release:  # the engine asked for the next item: keep that request for the next give/close
            self._asked.release()
        return True
