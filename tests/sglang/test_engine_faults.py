"""An SGLang engine that dies or stops answering in the middle of a call fails that call within seconds with one
line naming what died (``ProcessDied``) or the server's URL (``EngineUnreachable``), instead of hanging (or, for
the in-process engine, having SGLang kill this whole process tree); and nothing of the engine is left behind.
The HTTP server's case (``EngineUnreachable``) runs in test_http_and_eval.py, on that module's server (one server
start for both).

"In the middle": the plugin's pool log (``stats_path``) gains a line per forward; the fault is injected once a
decode forward of the call's request is logged (an explicit signal, waited for with a generous bound).

The other way round: the process that holds an in-process engine is killed (kill -9: the OOM killer, or torchrun
ending a rank) while the engine decodes; its scheduler and detokenizer end with it. Under torchrun, the trainer's
side of it (the whole run ends, nothing left) is tests/e2e/test_torchrun_faults.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
from sglang_helpers import FAULT_BOUND_S, in_thread, kill_session, read_stats, scheduler_env, wait_for_decoding

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

COMPRESSION = CompressionConfig(method="rkv", budget=8, window=2, buffer=4)
LONG = SamplingParams(temperature=1.0, max_new_tokens=4000, ignore_eos=True)
"""A response that runs for minutes on CPU (its compressed KV stays within B + W slots): still decoding when hit."""


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
        call, box = in_thread(lambda: engine.generate([[300, 12, 8, 77]], 2, LONG))
        wait_for_decoding(stats, mark, call)
        os.kill(children["scheduler_0"], signal.SIGKILL)
        call.join(FAULT_BOUND_S)
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


HOLDER = """
import sys
from sglang_ext import cpu_compat
cpu_compat.apply()
from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

compression = CompressionConfig(method="rkv", budget=8, window=2, buffer=4)
engine = SGLangRolloutEngine(SGLangEngineConfig(model_path=sys.argv[1], compression=compression, dtype="float32",
                                                max_total_tokens=1024, stats_path=sys.argv[2]))
print(" ".join(f"{name}={pid}" for name, pid in engine.client.watch.pids.items()), flush=True)
engine.generate([[300, 12, 8, 77]], 2, SamplingParams(temperature=1.0, max_new_tokens=4000, ignore_eos=True))
"""
"""A process that starts an engine, prints its processes' pids, then decodes for minutes."""


def test_a_process_killed_while_its_engine_decodes_takes_the_engine_along(tiny_model_dir, tmp_path):
    stats, err = tmp_path / "pool.jsonl", tmp_path / "holder.err"
    with open(err, "w") as log:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tiny_model_dir), str(stats)], text=True,
                                  stdout=subprocess.PIPE, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  start_new_session=True)
    try:
        line = holder.stdout.readline()  # the engine is up ("" if the holder ended first)
        while line and not line.startswith("scheduler_0="):
            line = holder.stdout.readline()
        pids = {name: int(pid) for name, pid in (x.split("=") for x in line.split())}
        assert set(pids) == {"scheduler_0", "detokenizer"}, err.read_text()[-3000:]
        engine = [psutil.Process(pid) for pid in pids.values()]
        assert sorted(p.name() for p in engine) == ["sglang::detokenizer", "sglang::scheduler"]  # SGLang's titles
        wait_for_decoding(stats, 0, holder, lambda: "\n" + err.read_text()[-3000:])
        holder.kill()
        assert holder.wait() == -signal.SIGKILL
        _, alive = psutil.wait_procs(engine, timeout=FAULT_BOUND_S)
        left = [(p.pid, p.name()) for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"left behind by the killed holder: {left}"
    finally:
        kill_session(holder)  # the engine's processes are in the holder's session: none outlives the test
