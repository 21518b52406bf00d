"""The plugin behind SGLang's HTTP server (``python -m sglang_ext.launch_server``), driven by
``SGLangRolloutEngine(urls=...)`` with weights pushed over a gloo process group; ``sparse-rl eval
--engine sglang`` (an in-process engine); and, last (it stops the module's server for good), a server that stops
answering in the middle of a call fails the call in one line naming its URL (``EngineUnreachable``): a hung
server (SIGSTOP) by its unanswered health checks, a gone one (SIGKILL) by refused connections. "In the middle":
the plugin's pool log (``stats_path``) gains a line per forward; the fault is injected once a decode forward of
the call's request is logged."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from sglang_helpers import (FAULT_BOUND_S, STRICT_MEMORY_CHECKS, assert_matches_reference, in_thread, kill_session,
                            read_stats, teacher_forced, wait_for_decoding)

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

COMPRESSION = CompressionConfig(method="snapkv", budget=10, window=2, buffer=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_env() -> dict:
    return {**os.environ, **STRICT_MEMORY_CHECKS,
            "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    port = _free_port()
    where = tmp_path_factory.mktemp("server")
    log, stats = where / "server.log", where / "pool.jsonl"
    config = {"compression": {"method": "rkv", "budget": 12, "window": 3, "buffer": 4}, "kept_digest": True,
              "stats_path": str(stats)}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_ext.launch_server", "--sparse-kv-config", json.dumps(config),
             "--model-path", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--max-total-tokens", "1024", "--random-seed", "0", "--log-level", "error"],
            env=_launcher_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:   # fail fast (with the server's log) if it dies while starting
        try:
            urllib.request.urlopen(url + "/health_generate", timeout=30).read()
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGTERM)
                pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(2)
    yield url, proc, log, stats
    kill_session(proc)  # (the last test has killed it already)


def test_http_server_samples_like_the_reference_and_takes_weights_over_gloo(server, tiny_model_dir, hf_model):
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine
    from sparse_rl_megatron.models.tiny import build_tiny_model

    url, proc, log, _ = server
    config = SGLangEngineConfig(model_path=str(tiny_model_dir), urls=[url], compression=COMPRESSION,
                                weight_sync="distributed", distributed_backend="gloo", startup_timeout_s=900)
    engine = SGLangRolloutEngine(config)
    prompts = ["First, 2 + 3 = 5. Then", [5, 17, 42]]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
    samples = engine.generate(prompts, 2, sampling)          # the client's compression goes per request
    assert all(s.compression.method == "snapkv" and s.compression.budget == 10 for s in samples)
    assert max(s.compression.events for s in samples) >= 2 and samples[0].prompt_text == prompts[0]
    assert_matches_reference(samples, teacher_forced(hf_model, COMPRESSION, samples), hf_model)

    other = build_tiny_model(seed=11, init_std=0.2)
    engine.update_weights(list(other.state_dict().items()), version=7)
    samples = engine.generate(prompts, 2, sampling)
    assert all(s.weight_version == 7 for s in samples)
    assert_matches_reference(samples, teacher_forced(other, COMPRESSION, samples), other)
    engine.shutdown()
    assert proc.poll() is None, log.read_text()[-3000:]      # the strict memory checks never fired


def test_launcher_refuses_a_bad_config_before_starting_anything():
    proc = subprocess.run([sys.executable, "-m", "sglang_ext.launch_server", "--sparse-kv-config",
                           '{"compression": {"method": "rkv", "budget": 4, "window": 8}}', "--model-path", "x"],
                          env=_launcher_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --sparse-kv-config: sparse_kv.compression: CompressionConfig.budget must be > window (B - alpha "
        ">= 1 tokens are chosen by score); got budget=4, window=8")


def test_eval_cli_with_the_sglang_engine(tiny_model_dir, tmp_path):
    from sparse_rl_megatron.cli import main

    data = tmp_path / "add.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) for i in range(3)))
    out = tmp_path / "sglang.json"
    code = main(["eval", "--model", str(tiny_model_dir), "--engine", "sglang", "--benchmarks", str(data),
                 "--n", "2", "--max-new-tokens", "20", "--no-progress", "--verifier-timeout", "10",
                 "--compression", "rkv", "--budget", "12", "--window", "3", "--buffer", "4", "--output", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["meta"]["engine"] == "sglang" and result["meta"]["mode"] == "rkv-B12-W4"
    (bench,) = result["benchmarks"].values()
    samples = [s for p in bench["problems"] for s in p["samples"]]
    assert len(samples) == 6 and max(s["compression_events"] for s in samples) >= 1


def test_http_server_that_stops_answering_mid_generate_fails_the_call_naming_its_url(server, tiny_model_dir):
    from sparse_rl_megatron.rollout.server_liveness import EngineUnreachable
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    url, proc, log, stats = server
    assert proc.poll() is None, log.read_text()[-3000:]
    served = json.loads(urllib.request.urlopen(url + "/model_info", timeout=30).read())["weight_version"]
    config = SGLangEngineConfig(model_path=str(tiny_model_dir), urls=[url], compression=COMPRESSION,
                                weight_sync="distributed", startup_timeout_s=900, request_retries=2,
                                health_check_s=1.0)
    engine = SGLangRolloutEngine(config, weight_version=0 if served == "default" else int(served))
    # 1. a server that hangs (SIGSTOP): its /health checks go unanswered, retries + 1 in a row
    mark = len(read_stats(stats))
    long = SamplingParams(temperature=1.0, max_new_tokens=4000, ignore_eos=True)  # minutes of decoding on CPU
    call, box = in_thread(lambda: engine.generate([[300, 12, 8, 77]], 2, long))
    wait_for_decoding(stats, mark, call)
    os.killpg(proc.pid, signal.SIGSTOP)
    call.join(FAULT_BOUND_S)
    assert not call.is_alive() and isinstance(box.get("error"), EngineUnreachable), box
    assert str(box["error"]).startswith(f"SGLang server {url} stopped answering: no answer to /health 3 times in "
                                        "a row (every 1 s) while POST /generate waited for it"), box["error"]
    # 2. a server that is gone (SIGKILL of its whole process group): refused, retried twice, then one line
    kill_session(proc)
    with pytest.raises(EngineUnreachable) as err:
        engine.client.flush_cache()
    assert str(err.value).startswith(f"SGLang server {url} stopped answering: POST /flush_cache: ") and (
        "(3 tries over " in str(err.value)) and "\n" not in str(err.value), err.value
    with pytest.raises(EngineUnreachable, match=f"^SGLang server {url} stopped answering: "):
        engine.generate([[5, 17, 42]], 1, SamplingParams(max_new_tokens=4))  # by its retries or its checks
    engine.shutdown()
