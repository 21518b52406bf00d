"""When an engine server has stopped answering: bounded retries, then one line naming its URL.

An HTTP call to an SGLang server can fail because the server is gone (refused, reset, closed mid-answer), because
it is briefly unavailable (a router answering 502-504 while a backend restarts), or because it hangs (stopped,
wedged). ``HttpClient`` (``sglang_client.py``) retries the first two ``retries`` times, waiting
``RETRY_WAIT_S * 2**attempt`` between tries, and while a long call (a generate) is outstanding it asks each
server it waits for ``/health`` every ``health_check_s`` seconds: a server that misses ``retries + 1`` checks
in a row has stopped answering. Either way the call raises ``EngineUnreachable``, whose message is one line.
"""
from __future__ import annotations

import concurrent.futures
import http.client
import socket
import time
import urllib.error
import urllib.request
from typing import Callable

from sparse_rl_megatron.utils.errors import RunFailed

RETRY_WAIT_S = 2.0
"""First wait before retrying a call that found no server (then doubled per retry: 2, 4, 8 s, ...)."""
RETRIED_HTTP_CODES = (502, 503, 504)
"""Answers of a proxy or router whose backend is briefly unavailable: worth another try."""


class EngineUnreachable(RunFailed):
    """An engine server stopped answering; the message names its URL, the call and what happened."""


class NoAnswer(Exception):
    """One try of a call got no usable answer from the server (the reason is the message)."""


def no_answer_reason(err: BaseException) -> str | None:
    """Why ``err`` (raised by ``urlopen``) means the server did not answer, or None if it did answer."""
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code}" if err.code in RETRIED_HTTP_CODES else None
    if isinstance(err, urllib.error.URLError):
        return str(err.reason)
    if isinstance(err, (ConnectionError, http.client.HTTPException, socket.timeout, TimeoutError)):
        return f"{type(err).__name__}: {err}".rstrip(": ")
    return None


def with_retries(url: str, call: str, once: Callable[[], object], retries: int) -> object:
    """``once()``, retried ``retries`` times while it raises ``NoAnswer``; then ``EngineUnreachable``."""
    t0 = time.monotonic()
    for attempt in range(retries + 1):
        try:
            return once()
        except NoAnswer as err:
            if attempt == retries:
                raise EngineUnreachable(
                    f"SGLang server {url} stopped answering: {call}: {err} ({attempt + 1} tries over "
                    f"{time.monotonic() - t0:.0f} s)") from None
            time.sleep(RETRY_WAIT_S * 2 ** attempt)
    raise AssertionError("unreachable")


def answers_health(url: str, timeout_s: float) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=timeout_s).read()
        return True
    except Exception:  # noqa: BLE001 - any failure is a missed check
        return False


def wait_for_answers(futures: dict[concurrent.futures.Future, str], call: str, *, health_check_s: float,
                     retries: int) -> None:
    """Wait until every future (of a call to the server ``futures[f]``) is done, checking meanwhile that the
    servers still waited for answer ``/health``; raise ``EngineUnreachable`` for one that missed ``retries + 1``
    checks in a row. (The futures' own errors are left to the caller.)"""
    pending = dict(futures)
    misses: dict[str, int] = {}
    while pending:
        done, _ = concurrent.futures.wait(list(pending), timeout=health_check_s)
        for fut in done:
            pending.pop(fut)
        for url in sorted(set(pending.values())):
            if answers_health(url, health_check_s):
                misses[url] = 0
                continue
            misses[url] = misses.get(url, 0) + 1
            if misses[url] > retries:
                raise EngineUnreachable(
                    f"SGLang server {url} stopped answering: no answer to /health {misses[url]} times in a row "
                    f"(every {health_check_s:g} s) while {call} waited for it")
