"""The radix-cache flush of an SGLang HTTP server is verified (issue 41): ``HttpClient.flush_cache`` asks SGLang to
wait for the engine to go idle (``/flush_cache?timeout=``) and raises ``CacheNotFlushed``, one line naming the
server, when it answers that it could not flush (HTTP 400). Before issue 41 the client flushed at once (a busy
engine refuses) and ``SGLangRolloutEngine`` never learnt of the refusal in process; the engine side is
``tests/sglang/test_sglang_engine.py::test_a_weight_update_waits_for_the_engine_to_go_idle_before_it_flushes``. A
stub server stands in for SGLang's endpoints (the same answers as SGLang 0.5.23's ``http_server.flush_cache``)."""
from __future__ import annotations

import http.server
import threading
from urllib.parse import parse_qs, urlsplit

import pytest

from sparse_rl_megatron.rollout.sglang_client import CacheNotFlushed, HttpClient


class _Stub(http.server.BaseHTTPRequestHandler):
    flushed: list = []
    """Each flush's ``timeout`` query; the server flushes when it is given one of at least ``idle_after``."""
    idle_after = 0.0

    def do_GET(self):   # /health_generate: the client's start-up check
        self._answer(200, "")

    def do_POST(self):
        url = urlsplit(self.path)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if url.path != "/flush_cache":
            return self._answer(404, "")
        timeout = float(parse_qs(url.query).get("timeout", ["0"])[0])
        self.flushed.append(timeout)
        if timeout >= self.idle_after:
            return self._answer(200, "Cache flushed.\n")
        self._answer(400, "Timed out waiting for idle state.")

    def _answer(self, code: int, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Stub.flushed = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_the_flush_waits_for_idle_and_a_refused_one_fails_in_one_line(server):
    client = HttpClient([server], timeout_s=30, startup_timeout_s=30, retries=0)
    _Stub.idle_after = 5.0   # the engine goes idle 5 s into a flush that waits that long
    client.flush_cache(timeout_s=30)
    assert _Stub.flushed == [30.0]
    with pytest.raises(CacheNotFlushed) as err:
        client.flush_cache(timeout_s=2)   # it stays busy longer than the flush may wait
    assert str(err.value) == (f"SGLang server {server} did not flush its radix cache within 2 s (Timed out waiting for "
                              "idle state): the engine was not idle (requests still queued or running, e.g. an abort "
                              "not yet processed)")
    client.shutdown()
