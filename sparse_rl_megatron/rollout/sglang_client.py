"""How the SGLang rollout engine talks to SGLang: an in-process ``sglang.Engine``, or HTTP servers.

Both clients offer the same calls, named after SGLang's endpoints (``generate``, ``begin_weight_update``,
``update_weights_from_disk``, ...), take the fields of SGLang's request objects (one dict per server), and
raise ``RuntimeError`` naming the call and SGLang's message when it fails. Only the in-process client can
send tensors directly (``update_weights_from_tensor``); HTTP servers get weights over a process group or
from disk.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from sparse_rl_megatron.rollout.sglang_config import FLUSH_TIMEOUT_S
from sparse_rl_megatron.utils.errors import RunFailed
from multiprocessing import forkserver, resource_tracker
from sparse_rl_megatron.rollout.server_liveness import (
    EngineUnreachable, NoAnswer, no_answer_reason, wait_for_answers, with_retries,
)
from sparse_rl_megatron.utils.process_watch import ProcessWatch

# The io_struct request class of every call the engine makes (in-process calls build these objects).
_REQUEST_CLASSES = {
    "begin_weight_update": "BeginWeightUpdateReqInput",
    "end_weight_update": "EndWeightUpdateReqInput",
    "update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}


SGLANG_MEMORY_TAGS: dict[str, tuple[str, ...]] = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}
"""SGLang's memory tags (``sglang.srt.constants.GPU_MEMORY_TYPE_*``) of each of ``ENGINE_MEMORY_PARTS``: the
captured CUDA graphs come back with the KV cache they read."""


def sglang_memory_tags(parts: Sequence[str]) -> list[str]:
    """The SGLang tags to resume for ``parts`` (each a key of ``SGLANG_MEMORY_TAGS``)."""
    return [tag for part in parts for tag in SGLANG_MEMORY_TAGS[part]]


def _check(call: str, result: Any) -> Any:
    """SGLang answers (success, message, ...) tuples in-process and {"success", "message"} over HTTP."""
    if isinstance(result, dict) and "success" in result:
        ok, message = result["success"], result.get("message", "")
    elif isinstance(result, (tuple, list)) and result and isinstance(result[0], bool):
        ok, message = result[0], (result[1] if len(result) > 1 else "")
    else:
        ok, message = getattr(result, "success", True), getattr(result, "message", "")
    if not ok:
        raise RuntimeError(f"SGLang {call} failed: {message}")
    return result


class CacheNotFlushed(RunFailed):
    """SGLang did not flush its radix cache: the engine did not go idle within the flush's timeout. The message is
    one line naming the server and why."""


class HttpRefused(ValueError):
    """An SGLang server answered HTTP 400: the request itself was refused (``detail``: what the server said)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


def _not_flushed(where: str, timeout_s: float, detail: str) -> CacheNotFlushed:
    reason = " ".join(detail.split()).rstrip(".") or "requests still queued or running"
    return CacheNotFlushed(f"{where} did not flush its radix cache within {timeout_s:g} s ({reason}): the engine was "
                           "not idle (requests still queued or running, e.g. an abort not yet processed)")


class EngineProcessFailed(RuntimeError):
    """A child process of the in-process SGLang engine (scheduler, detokenizer) failed while it started."""


FAILED_CHILD_WAIT_S = 3.0
"""How long a SIGQUIT handler waits for the failing child to exit after it signalled (it signals, then exits)."""


def _one_exits(children: list, wait_s: float) -> bool:
    """Whether one of ``children`` (psutil processes) exits or is a zombie within ``wait_s`` seconds."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        for child in children:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


class ChildFailedHandler:
    """SIGQUIT handler for an in-process engine's launch phase.

    SGLang's children send SIGQUIT to their parent when they fail, and SGLang's own handler then kills the whole
    process tree, the parent included: the trainer (or pytest) would vanish without a word. This one kills only
    the processes started since it was made (the engine's), then raises in the main thread, so the caller gets
    an error naming the engine (the child's own log is printed above it) and can save, report or retry.
    Once the engine serves, SGLang's tokenizer manager installs its running-phase handler instead.
    """

    def __init__(self):
        import psutil

        self.before = {p.pid for p in psutil.Process().children(recursive=True)}

    def new_children(self) -> list:
        import psutil

        return [p for p in psutil.Process().children(recursive=True) if p.pid not in self.before]

    def __call__(self, signum, frame):
        import psutil

        children = self.new_children()
        if not _one_exits(children, FAILED_CHILD_WAIT_S):
            # the sender was not this engine: a SubprocessWatchdog thread an earlier engine of this process left
            # running reports the scheduler its own shutdown killed. SGLang's start-up still notices a scheduler
            # of this engine that dies (it polls them), so ignoring the signal hides nothing.
            print(f"sparse-rl: ignored a SIGQUIT while the SGLang engine starts: none of its {len(children)} "
                  f"processes has exited (a stale report from an earlier engine in this process)", file=sys.stderr)
            return
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        raise EngineProcessFailed(
            f"the in-process SGLang engine failed while starting: a child process signalled a failure (its log is "
            f"above); {len(children)} engine process(es) stopped")


def engine_processes(engine) -> list[tuple[str, Any]]:
    """``(name, multiprocessing.Process)`` of an ``sglang.Engine``'s children: ``scheduler_<i>`` per TP x PP
    rank and ``detokenizer``, as SGLang's own liveness watchdog lists them (SGLang 0.5.23,
    ``Engine._launch_subprocesses``)."""
    watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
    if watchdog is None or not getattr(watchdog, "_processes", None):
        raise RuntimeError("the in-process SGLang engine lists no child processes to watch (SGLang changed?)")
    return list(zip(watchdog._names, watchdog._processes))


@contextlib.contextmanager
def children_killed_if_it_raises():
    """Kill the child processes started inside the block (and what they started) if the block raises.

    ``sglang.Engine(...)`` spawns its scheduler and detokenizer, then waits for them: interrupted there (Ctrl-C, a
    stop signal, a scheduler that failed) it leaves the children already running, and a child still importing
    SGLang has not yet asked the kernel to end it with its parent, so it outlives this process as an orphan."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children()}
    try:
        yield
    except BaseException:
        kept = before | _shared_helpers()
        started = [p for p in me.children() if p.pid not in kept]
        for proc in [d for p in started for d in _descendants(p)] + started:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(started, timeout=10)
        raise


def _shared_helpers() -> set[int]:
    """The pids of multiprocessing's own helpers (resource tracker, forkserver) this process may have started
    meanwhile: shared by every later child, not the engine's."""
    pids = {resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid}
    return {pid for pid in pids if pid is not None}


def _descendants(proc) -> list:
    import psutil

    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class InProcessClient:
    """An ``sglang.Engine`` in this process (its schedulers and detokenizer are child processes).

    Every call runs under a ``ProcessWatch`` of those children: if one dies (killed, out of memory, a crash)
    the call raises ``ProcessDied`` naming it within a fraction of a second, instead of waiting for an answer
    that never comes. SGLang's own reactions are taken back once the engine serves: its running-phase SIGQUIT
    handler (a child's failure report) would kill this whole process tree, the trainer included, and its
    SIGTERM handler would shut the engine down and ``sys.exit(0)`` this process in the middle of a step; here a
    SIGQUIT is only noted (the watch reports the death) and SIGTERM goes back to the handler this process had
    (the trainer's stop request: save at the end of the step).
    """

    num_servers = 1
    in_process = True
    """The engine runs in this process (its GPUs are this process's): NCCL weight sync from here cannot work."""

    def __init__(self, engine_kwargs: dict[str, Any]):
        import sglang

        handler = ChildFailedHandler() if "custom_sigquit_handler" not in engine_kwargs else None
        with children_killed_if_it_raises():
            self.engine = sglang.Engine(**engine_kwargs, **({"custom_sigquit_handler": handler} if handler else {}))
        self.watch = ProcessWatch("the SGLang engine", engine_processes(self.engine))
        self.failure_reports = 0
        """SIGQUITs received from the engine's processes (their failure reports) once it served."""
        self._take_back_signals()

    def _take_back_signals(self) -> None:
        import asyncio
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # SGLang installs no signal handler outside the main thread either
        previous = signal.getsignal(signal.SIGTERM)
        tm = self.engine.tokenizer_manager

        async def start_handle_loop():  # SGLang does it at the first request; inside the loop, as there
            tm.auto_create_handle_loop()
            # and its handlers go while the loop runs: uvloop (SGLang's loop) removes none while it is stopped, and
            # re-arms them at every later run, where they fire beside the process handlers set below (a scheduler's
            # failure report during a call then killed this whole process tree: a timing race)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGQUIT):
                loop.remove_signal_handler(sig)

        self.engine.loop.run_until_complete(start_handle_loop())
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        signal.signal(signal.SIGQUIT, self._on_failure_report)

    def _on_failure_report(self, signum, frame) -> None:
        self.failure_reports += 1  # the watch names the process that died; a stale report changes nothing

    def _wait(self, awaitable) -> Any:
        """Run ``awaitable`` on the engine's event loop; ``ProcessDied`` if an engine process dies meanwhile."""
        return self.engine.loop.run_until_complete(self.watch.guard(awaitable))

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict], groups=None,
                 logprob_start_len: list[int] | None = None) -> list[dict]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(input_ids=input_ids, sampling_params=sampling_params, return_logprob=True,
                               logprob_start_len=logprob_start_len)

        async def first():  # what Engine.generate returns: the first (for a non-streamed request, only) answer
            return await self.engine.tokenizer_manager.generate_request(obj, None).__anext__()

        return self._wait(first())

    def _run(self, name: str, fields: dict) -> Any:
        from sglang.srt.managers import io_struct

        obj = getattr(io_struct, _REQUEST_CLASSES[name])(**fields)
        method = getattr(self.engine.tokenizer_manager, name)
        return _check(name, self._wait(method(obj, None)))

    def call_each(self, name: str, per_server: list[dict]) -> list[Any]:
        return [self._run(name, per_server[0])]

    def submit_each(self, name: str, per_server: list[dict]) -> list[concurrent.futures.Future]:
        """Run the call on a helper thread (a collective the caller joins from this thread)."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        future = pool.submit(self._run, name, per_server[0])
        pool.shutdown(wait=False)
        return [future]

    def update_weights_from_tensor(self, named_tensors: list, weight_version: str) -> None:
        self.update_weights_from_payloads(self.engine._serialize_tensors_per_rank(named_tensors, None), weight_version)

    def update_weights_from_payloads(self, payloads: list, weight_version: str) -> None:
        """Load one bucket given as one serialized payload per TP rank (TP rank r deserializes ``payloads[r]``)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=None, flush_cache=False,
                                              weight_version=weight_version)
        coro = self.engine.tokenizer_manager.update_weights_from_tensor(obj, None)
        _check("update_weights_from_tensor", self._wait(coro))

    def server_infos(self) -> list[dict]:
        """The engine's resolved arguments (SGLang's server info), one entry."""
        return [self.engine.get_server_info()]

    def flush_cache(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Flush SGLang's radix cache once the engine is idle: SGLang defers the flush while requests are queued or
        running and retries it at every scheduler step, for ``timeout_s`` at most. ``CacheNotFlushed`` if it could
        not."""
        result = self._wait(self.engine.tokenizer_manager.flush_cache(timeout_s=timeout_s))
        if not result.success:
            raise _not_flushed("the in-process SGLang engine", timeout_s, result.message)

    def release_memory(self, parts: Sequence[str]) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        obj = ReleaseMemoryOccupationReqInput(tags=sglang_memory_tags(parts))
        self._wait(self.engine.tokenizer_manager.release_memory_occupation(obj, None))

    def resume_memory(self, parts: Sequence[str]) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        obj = ResumeMemoryOccupationReqInput(tags=sglang_memory_tags(parts))
        self._wait(self.engine.tokenizer_manager.resume_memory_occupation(obj, None))

    def shutdown(self) -> None:
        self.engine.shutdown()


class HttpClient:
    """Running SGLang servers (or one router): requests are spread over them, control calls go to all.

    A server that stops answering fails the call after bounded retries with one line naming its URL
    (``server_liveness.py``): ``retries`` more tries of a call that found no server, and ``/health`` checks every
    ``health_check_s`` seconds while a call waits for it."""

    in_process = False
    """The servers run in processes of their own (anywhere)."""

    def __init__(self, urls: list[str], *, timeout_s: float, startup_timeout_s: float, retries: int = 3,
                 health_check_s: float = 30.0):
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.retries = retries
        self.health_check_s = health_check_s
        self.num_servers = len(self.urls)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(4, 2 * len(self.urls)))
        deadline = time.monotonic() + startup_timeout_s
        for url in self.urls:
            self._wait_healthy(url, deadline)

    def _request(self, url: str, path: str, body: dict | None, *, method: str = "POST") -> Any:
        call = f"{method} {path.split('?')[0]}"   # what the messages name: the endpoint
        return with_retries(url, call, lambda: self._request_once(url, path, body, method), self.retries)

    def _request_once(self, url: str, path: str, body: dict | None, method: str) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                text = resp.read().decode()
        except TimeoutError:  # not retried: the call may take that long at most (request_timeout_s)
            raise EngineUnreachable(f"SGLang server {url} stopped answering: {method} {path}: no answer within "
                                    f"{self.timeout_s:g} s (request_timeout_s)") from None
        except Exception as err:
            reason = no_answer_reason(err)
            if reason is not None:
                raise NoAnswer(reason) from None
            if not isinstance(err, urllib.error.HTTPError):
                raise
            detail = err.read().decode(errors="replace")[:500]
            message = f"SGLang server {url}{path} answered HTTP {err.code}: {detail}"
            if err.code == 400:   # the request itself was refused
                raise HttpRefused(message, detail) from None
            raise RuntimeError(message) from None
        try:
            return json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return text  # e.g. /flush_cache answers plain text

    def _results(self, futures: list[concurrent.futures.Future], urls: list[str], call: str) -> list[Any]:
        """The futures' results, in order; a server that stops answering meanwhile fails the call."""
        wait_for_answers(dict(zip(futures, urls)), call, health_check_s=self.health_check_s, retries=self.retries)
        return [f.result() for f in futures]

    def _wait_healthy(self, url: str, deadline: float) -> None:
        while True:
            try:
                urllib.request.urlopen(url + "/health_generate", timeout=30).read()
                return
            except Exception as err:  # connection refused while starting, 503 while warming up
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SGLang server {url} did not become healthy in time: {err}") from None
                time.sleep(2.0)

    def align_weight_version(self, version: str) -> None:
        """Servers that never got a version (SGLang's ``default``) take ``version``; any other must match it."""
        for url in self.urls:
            current = str((self._request(url, "/model_info", None, method="GET") or {}).get("weight_version"))
            if current == "default":
                _check("update_weight_version", self._request(
                    url, "/update_weight_version", {"new_version": version, "abort_all_requests": False}))
            elif current != version:
                raise ValueError(f"SGLang server {url} is at weight version {current}, not {version}; pass "
                                 f"weight_version={current} to SGLangRolloutEngine (or update its weights)")

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict], groups=None,
                 logprob_start_len: list[int] | None = None) -> list[dict]:
        """Requests of one group (``groups[j]``, default: each its own) go to one server, so they share
        the prompt's KV in its radix cache. ``logprob_start_len[j]``: also return the log-probs of request j's
        input tokens from that position on (``meta_info['input_token_logprobs']``)."""
        n = len(self.urls)
        groups = list(range(len(input_ids))) if groups is None else groups
        shards = [[j for j in range(len(input_ids)) if groups[j] % n == i] for i in range(n)]
        def body(idx: list[int]) -> dict:
            out = {"input_ids": [input_ids[j] for j in idx], "sampling_params": [sampling_params[j] for j in idx],
                   "return_logprob": True}
            if logprob_start_len is not None:
                out["logprob_start_len"] = [logprob_start_len[j] for j in idx]
            return out

        busy = [(url, idx) for url, idx in zip(self.urls, shards) if idx]
        futures = [self._pool.submit(self._request, url, "/generate", body(idx)) for url, idx in busy]
        out: list[dict] = [None] * len(input_ids)  # type: ignore[list-item]
        for (url, idx), result in zip(busy, self._results(futures, [u for u, _ in busy], "POST /generate")):
            result = result if isinstance(result, list) else [result]
            for j, r in zip(idx, result):
                out[j] = r
        return out

    def call_each(self, name: str, per_server: list[dict]) -> list[Any]:
        """POST ``/name`` to every server at once, each with its own body."""
        futures = [self._pool.submit(self._request, url, f"/{name}", body) for url, body in zip(self.urls, per_server)]
        return [_check(name, r) for r in self._results(futures, self.urls, f"POST /{name}")]

    def submit_each(self, name: str, per_server: list[dict]) -> list[concurrent.futures.Future]:
        """Like :meth:`call_each` without waiting (collective calls must run while this process joins in)."""
        return [self._pool.submit(lambda u, b: _check(name, self._request(u, f"/{name}", b)), url, body)
                for url, body in zip(self.urls, per_server)]

    def server_infos(self) -> list[dict]:
        """Each server's resolved arguments (SGLang's server info), in ``urls`` order."""
        return [self._request(url, "/server_info", None, method="GET") for url in self.urls]

    def flush_cache(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Flush every server's radix cache once it is idle (``/flush_cache?timeout=``: SGLang defers the flush while
        requests are queued or running, for ``timeout_s`` at most, and answers HTTP 400 if it could not).
        ``CacheNotFlushed`` naming the first server that did not."""
        for url in self.urls:
            try:
                self._request(url, f"/flush_cache?timeout={timeout_s:g}", {})
            except HttpRefused as err:
                raise _not_flushed(f"SGLang server {url}", timeout_s, err.detail) from None

    def release_memory(self, parts: Sequence[str]) -> None:
        for url in self.urls:
            self._request(url, "/release_memory_occupation", {"tags": sglang_memory_tags(parts)})

    def resume_memory(self, parts: Sequence[str]) -> None:
        for url in self.urls:
            self._request(url, "/resume_memory_occupation", {"tags": sglang_memory_tags(parts)})

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
