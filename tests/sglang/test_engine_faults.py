"""An SGLang engine that dies or stops answering in the middle of a call fails that call within seconds with one
line naming what died (``ProcessDied``) or the server's URL (``EngineUnreachable``), instead of hanging (or, for
the in-process engine, having SGLang kill this whole process tree); and nothing of the engine is left behind.

"In the middle": the plugin's pool log (``stats_path``) gains a line per forward; the fault is injected once a
decode forward of the call's request is logged (an explicit signal, waited for with a generous bound)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from sglang_helpers import STRICT_MEMORY_CHECKS, kill_session, read_stats, scheduler_env

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine import SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

BOUND_S = 120.0
"""Generous bound on every wait (what is waited for takes well under a second once it happens)."""
COMPRESSION = CompressionConfig(method="rkv", budget=8, window=2, buffer=4)
LONG = SamplingParams(temperature=1.0, max_new_tokens=4000, ignore_eos=True)
"""A response that runs for minutes on CPU (its compressed KV stays within B + W slots): still decoding when hit."""


def _wait_for_decoding(stats: Path, since: int, call: threading.Thread) -> None:
    """Until the pool log shows a decode forward past line ``since`` (the call's request is being served)."""
    deadline = time.monotonic() + BOUND_S
    while not any(x.get("decode") for x in read_stats(stats)[since:]):
        assert call.is_alive() and time.monotonic() < deadline, "the call ended (or never decoded) before the fault"
        time.sleep(0.05)


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


async def _loop_signal_handlers() -> list:
    """SIGTERM / SIGQUIT handlers the running event loop holds (removed if any: uvloop only sees them running)."""
    import asyncio

    loop = asyncio.get_running_loop()
    return [s for s in (signal.SIGTERM, signal.SIGQUIT) if loop.remove_signal_handler(s)]


def test_scheduler_killed_in_the_middle_of_generate_fails_the_call_naming_it(tiny_model_dir, tmp_path):
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine
    from sparse_rl_megatron.utils.process_watch import ProcessDied

    stats = tmp_path / "pool.jsonl"
    config = SGLangEngineConfig(model_path=str(tiny_model_dir), compression=COMPRESSION, dtype="float32",
                                max_total_tokens=1024, stats_path=str(stats))

    def trainer_stop(signum, frame):  # stands for the trainer's stop request (trainer/runtime/signals.py)
        pass

    previous = signal.signal(signal.SIGTERM, trainer_stop)
    try:
        with scheduler_env():
            engine = SGLangRolloutEngine(config)
        children = engine.client.watch.pids
        assert set(children) == {"scheduler_0", "detokenizer"}
        engine.generate([[5, 17, 42]], 1, SamplingParams(max_new_tokens=4))  # the engine serves...
        # ...and SGLang's own SIGTERM handler (it shuts the engine down and exits this process) is not in place
        assert signal.getsignal(signal.SIGTERM) is trainer_stop
        # nor inside its event loop, which runs during every call (uvloop keeps a handler removed while it is
        # stopped and fires it beside the process handler: SGLang's SIGQUIT handler killed this process tree)
        assert engine.client.engine.loop.run_until_complete(_loop_signal_handlers()) == []

        mark = len(read_stats(stats))
        call, box = _in_thread(lambda: engine.generate([[300, 12, 8, 77]], 2, LONG))
        _wait_for_decoding(stats, mark, call)
        os.kill(children["scheduler_0"], signal.SIGKILL)
        call.join(BOUND_S)
        assert not call.is_alive(), "generate still waits for a scheduler that is dead"
        err = box.get("error")
        assert isinstance(err, ProcessDied), box
        assert str(err) == (f"the SGLang engine's process scheduler_0 (pid {children['scheduler_0']}) was killed by "
                            "signal SIGKILL")
        with pytest.raises(ProcessDied):  # every later call fails at once, naming the same process
            engine.client.flush_cache()
        engine.shutdown()
    finally:
        signal.signal(signal.SIGTERM, previous)
    # this process lived on (SGLang alone would have killed its whole process tree), and nothing is left
    for pid in children.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def _start_server(model_dir: Path, port: int, stats: Path, log: Path) -> subprocess.Popen:
    config = {"compression": {"method": "rkv", "budget": 8, "window": 2, "buffer": 4}, "stats_path": str(stats)}
    env = {**os.environ, **STRICT_MEMORY_CHECKS,
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sglang_ext.launch_server", "--sparse-kv-config", json.dumps(config),
             "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--max-total-tokens", "1024", "--random-seed", "0", "--log-level", "error"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def test_http_server_that_stops_answering_mid_generate_fails_the_call_naming_its_url(tiny_model_dir, tmp_path):
    from sparse_rl_megatron.rollout.server_liveness import EngineUnreachable
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url, stats, log = f"http://127.0.0.1:{port}", tmp_path / "pool.jsonl", tmp_path / "server.log"
    server = _start_server(tiny_model_dir, port, stats, log)
    try:
        config = SGLangEngineConfig(model_path=str(tiny_model_dir), urls=[url], compression=COMPRESSION,
                                    weight_sync="distributed", startup_timeout_s=900,
                                    request_retries=2, health_check_s=1.0)
        engine = SGLangRolloutEngine(config)
        # 1. a server that hangs (SIGSTOP): its /health checks go unanswered, retries + 1 in a row
        mark = len(read_stats(stats))
        call, box = _in_thread(lambda: engine.generate([[300, 12, 8, 77]], 2, LONG))
        _wait_for_decoding(stats, mark, call)
        os.killpg(server.pid, signal.SIGSTOP)
        call.join(BOUND_S)
        assert not call.is_alive() and isinstance(box.get("error"), EngineUnreachable), box
        assert str(box["error"]).startswith(f"SGLang server {url} stopped answering: no answer to /health 3 times in "
                                            "a row (every 1 s) while POST /generate waited for it"), box["error"]
        # 2. a server that is gone (SIGKILL of its whole process group): refused, retried twice, then one line
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(BOUND_S)
        with pytest.raises(EngineUnreachable) as err:
            engine.client.flush_cache()
        assert str(err.value).startswith(f"SGLang server {url} stopped answering: POST /flush_cache: ") and (
            "(3 tries over " in str(err.value)) and "\n" not in str(err.value), err.value
        with pytest.raises(EngineUnreachable, match=f"^SGLang server {url} stopped answering: "):
            engine.generate([[5, 17, 42]], 1, SamplingParams(max_new_tokens=4))  # by its retries or its checks
        engine.shutdown()
    finally:
        kill_session(server)
