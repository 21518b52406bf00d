"""``pause_generation(mode="retract")`` on a server holding compressed requests: paused in place instead (issue 41).

SGLang's retract pause (an RL driver's pause before a weight sync, ``/pause_generation``) releases every running
request's KV and re-queues it, to be re-prefilled from its tokens after ``continue_generation``. A request the
plugin has compressed cannot be rebuilt that way: its dense KV is gone, and the K/V of every response token past
the first layer were computed over the *compressed* cache, so a dense re-prefill gives other K/V (another sampling
distribution than the HF reference's); re-compressing at once would not match the reference's compression schedule
either. Before issue 41 the plugin refused each such request at its retraction (``release_req`` hook): every
compressed request in flight ended aborted, and the driver lost all of them.

Now, when a retract pause finds compressed requests running (``compressed_running``), the scheduler pauses in place
instead (``mode="in_place"``, SGLang's other pause: requests keep their KV and rows and continue after
``continue_generation`` exactly where they stopped, so their samples are what an unpaused run gives; requests queued
keep waiting). Nothing is lost. The trade-off is SGLang's documented one for ``in_place``: a cache flush during the
pause is refused while requests hold KV (the engine is not idle), so a weight update's flush waits for them
(``SGLangRolloutEngine``: until ``flush_timeout_s``, then the update fails in one line) and a driver that updates
weights mid-pause gets SGLang's "cache was not flushed" answer; requests continued after a weight update span two
weight versions (SGLang records each response's ``weight_versions``; ``SGLangRolloutEngine`` refuses such a sample).
A retract pause with no compressed request running is SGLang's own (dense and not-yet-compressed requests are
rebuilt exactly by a re-prefill).
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

RETRACT, IN_PLACE = "retract", "in_place"


def compressed_running(backend, scheduler) -> list:
    """The unfinished requests of the scheduler's running and last batches that the plugin has compressed."""
    reqs = list(scheduler.running_batch.reqs)
    if scheduler.last_batch is not None:
        reqs += [r for r in scheduler.last_batch.reqs if r not in reqs]
    state = backend.state
    out = []
    for req in reqs:
        row = req.kv.req_pool_idx
        info = state.info[row] if row is not None else None
        if info is not None and info.req is req and not req.finished() and state.events[row] > 0:
            out.append(req)
    return out


def pause_mode(backend, scheduler, mode: str) -> str:
    """The mode a ``pause_generation(mode)`` runs with: ``in_place`` for a retract pause that would lose compressed
    requests, else ``mode``."""
    if mode != RETRACT:
        return mode
    held = compressed_running(backend, scheduler)
    if not held:
        return mode
    logger.warning("sparse_kv: pause_generation(mode='retract') with %d compressed request(s) running is paused in "
                   "place (their compressed KV cannot be rebuilt by a re-prefill); a cache flush waits until they "
                   "finish", len(held))
    return IN_PLACE
