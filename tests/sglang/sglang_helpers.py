"""Helpers of the SGLang tier (imported by name: a ``conftest`` import would find another tier's conftest when
the whole suite runs in one session): the tiny model's seed, the strict memory checks, the reference oracle."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the suite's error model
import numerics  # noqa: E402

MODEL_SEED, INIT_STD = 3, 0.2
"""The tiny Qwen2 (hidden 64, 2 layers, 4 query heads, 2 KV heads: GQA) every SGLang test loads."""

STRICT_MEMORY_CHECKS = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
}


def scheduler_env(**extra: str):
    """Environment seen by the SGLang processes started inside the block: the strict checks, plus ``extra``."""
    from sglang_ext.config import scheduler_env as with_env

    return with_env(**{**STRICT_MEMORY_CHECKS, **extra})


def teacher_forced(model, compression, samples):
    """The HF reference engine's replay of ``samples`` (same compressor and settings)."""
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    ref = HFRolloutEngine(model, compression=compression, show_progress=False)
    return ref.teacher_forced([s.prompt_ids for s in samples], [s.response_ids for s in samples])


def logprob_tolerance(model, prompts, responses) -> float:
    """The tier's log-prob tolerance for these sequences under ``model`` (the HF twin of the engine's weights):
    ``numerics.hf_logprob_tolerance``, the probabilistic rounding model of ``tests/numerics.py``."""
    return numerics.hf_logprob_tolerance(model, [list(p) for p in prompts], [list(r) for r in responses])


def assert_logprobs_match(got, want, model, prompt_ids, response_ids, what: str) -> None:
    """``got`` vs ``want`` (log-probs of ``response_ids`` after ``prompt_ids``) within ``logprob_tolerance``."""
    tol = logprob_tolerance(model, [prompt_ids], [response_ids])
    numerics.assert_logprobs_within(got, want, tol, f"sglang/{what}")


def assert_matches_reference(samples, reference, model) -> None:
    """Same log-probs within ``logprob_tolerance`` (``model``: the weights both were computed with) and the same
    compression record (events, peak, kept digest)."""
    for s, r in zip(samples, reference):
        assert_logprobs_match(s.sampler_logprobs, r.sampler_logprobs, model, s.prompt_ids, s.response_ids,
                              f"vs_teacher_forced[{s.compression.method}] sample {s.group_id}/{s.index_in_group}")
        got = (s.compression.events, s.compression.peak_kv_tokens, s.compression.kept_digest)
        want = (r.compression.events, r.compression.peak_kv_tokens, r.compression.kept_digest)
        assert got == want, f"sample {s.group_id}/{s.index_in_group}: {got} != {want}"


def read_stats(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def full_forward_logprobs(model, prompt_ids, response_ids) -> torch.Tensor:
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    p = len(prompt_ids)
    return logp[p - 1:-1].gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def generate_mixed(engine, jobs: dict):
    """One batch of requests with a compression each: ``jobs = {name: (prompt_ids, n, CompressionConfig,
    SamplingParams)}`` -> ``{name: [Sample] * n}`` (sent together, so they decode side by side)."""
    order = [(name, g, i) for g, name in enumerate(jobs) for i in range(jobs[name][1])]
    prompts = [jobs[name][0] for name, _, _ in order]
    params = [engine._sampling(jobs[name][3], g, i, 0, jobs[name][2]) for name, g, i in order]
    outs = engine.client.generate(prompts, params, groups=[g for _, g, _ in order])
    result: dict = {name: [] for name in jobs}
    for (name, g, i), out in zip(order, outs):
        result[name].append(engine._sample(out, jobs[name][0], jobs[name][0], g, i, jobs[name][3]))
    return result


def resolved_server_args(model_dir, config: dict | None, **overrides):
    """Server arguments resolved and checked exactly as ``sglang.Engine`` does before launching anything."""
    from sglang_ext import cpu_compat
    from sglang_ext.config import CONFIG_ENV

    cpu_compat.apply()
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # as sglang.Engine does first
    kwargs = {**cpu_compat.cpu_engine_kwargs(), "model_path": str(model_dir), "attention_backend": "sparse_kv",
              **overrides}
    with scheduler_env(**({CONFIG_ENV: json.dumps(config)} if config is not None else {})):
        args = ServerArgs(**kwargs)
        args.resolve_once()
        args.check_server_args()
    return args


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL to everything in ``proc``'s session (started with ``start_new_session=True``), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


FAULT_BOUND_S = 120.0
"""Generous bound on every wait of the fault tests (what is waited for takes well under a second once it happens)."""


def wait_for_decoding(stats: Path, since: int, call: threading.Thread | subprocess.Popen,
                      why: Callable[[], str] = lambda: "") -> None:
    """Until the plugin's pool log (``stats_path``: a line per forward) shows a decode forward past line ``since``:
    the call's request is being served, so a fault injected now lands in the middle of the call. ``call``: the
    thread or the process making it; ``why``: more for the message if it ends first (e.g. the process's log)."""
    deadline = time.monotonic() + FAULT_BOUND_S
    running = call.is_alive if isinstance(call, threading.Thread) else lambda: call.poll() is None
    while not any(x.get("decode") for x in read_stats(stats)[since:]):
        assert running() and time.monotonic() < deadline, f"the call ended (or never decoded) before the fault{why()}"
        time.sleep(0.05)


def in_thread(fn) -> tuple[threading.Thread, dict]:
    """``fn()`` in a daemon thread; the box gets its ``result`` or its ``error``."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box
