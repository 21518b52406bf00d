"""What the sparse_kv plugin refuses, and what happens when things go wrong.

- Bad settings are refused when the server starts (``ServerArgs.check_server_args``), before any model
  loads, with one line naming the field.
- A deliberately broken free (evicted slots dropped but never freed) is caught by SGLang's strict idle
  memory checker: the oracle of every other engine test really can fail.
- A forced retraction (SGLang's test switch, small pool, radix cache on) takes requests before their first
  compression only (re-prefilled and compressed the same way, correct); compressed ones are spared (issue 25,
  item 4: before, they were refused and resubmitted), never resumed dense; a retracted request puts only its
  prompt into the radix tree.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from sglang_helpers import (assert_logprobs_match, assert_matches_reference, full_forward_logprobs, kill_session,
                            resolved_server_args, scheduler_env, teacher_forced)

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
from sparse_rl_megatron.utils.config_io import ConfigError

RKV = {"method": "rkv", "budget": 8, "window": 2, "buffer": 4}


@pytest.mark.parametrize("config,overrides,message", [
    ({"compression": {"method": "foo"}}, {}, "unknown KV compression method 'foo'; valid names: h2o, none, rkv"),
    ({"compression": {"bugdet": 4}}, {}, "unknown key(s) bugdet; valid keys:"),
    ({"compression": {"method": "rkv", "budget": 4, "window": 8}}, {}, "budget must be > window"),
    ({"compression": {"method": "h2o"}}, {}, "'h2o' is not supported by the SGLang plugin"),
    ({"compression": {**RKV, "compress_prefill": True}}, {}, "compress_prefill is not supported"),
    ({"compression": RKV}, {"page_size": 2}, "page_size=2: sparse_kv needs page_size 1"),
    ({"compression": RKV}, {"disable_cuda_graph": False}, "does not support CUDA graphs"),
])
def test_bad_settings_are_refused_at_start_in_one_line(tiny_model_dir, config, overrides, message):
    with pytest.raises(ConfigError) as err:
        resolved_server_args(tiny_model_dir, config, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


_PROBE = textwrap.dedent("""
    import sys

    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine
    from sparse_rl_megatron.utils.process_watch import ProcessDied

    if __name__ == "__main__":
        config = SGLangEngineConfig(model_path=sys.argv[1], dtype="float32", max_total_tokens=1024,
                                    compression=CompressionConfig(method="rkv", budget=8, window=2, buffer=4))
        engine = SGLangRolloutEngine(config)
        try:
            engine.generate([[5, 17, 42]], 2, SamplingParams(max_new_tokens=20, ignore_eos=True))
        except ProcessDied as err:  # the checker can fire before the last outputs reach this process
            print(err, flush=True)
        # No flush_cache: a flush resets SGLang's allocator and would hide the leaked slots from a check that has
        # not run yet. The scheduler checks as soon as it idles after the requests end, and the strict checker's
        # error ends it: stay until then.
        print(engine.client.watch.wait(float(sys.argv[2])), flush=True)
        engine.shutdown()
""")

LEAK_REPORT = "memory leak detected"
"""What SGLang's strict idle checker raises with (``invariant_checker._report_leak``), logged by the scheduler."""
PROBE_TIMEOUT_S = 300
"""Bound on the probe: engine start (~25 s CPU, minutes on a loaded machine), one generate, the checker."""


def test_strict_checker_catches_a_deliberately_broken_free(tiny_model_dir, tmp_path):
    from sglang_ext.config import FAULT_ENV

    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    log_path = tmp_path / "probe.log"
    # the idle checker alone (the busy one, on in the other tests, would stop it one step earlier)
    with scheduler_env(**{FAULT_ENV: "skip_free", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "0"}):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        with open(log_path, "w") as log_file:
            # its own session: everything it started is stopped at the end, however far it got
            proc = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir), str(PROBE_TIMEOUT_S)],
                                    env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=PROBE_TIMEOUT_S)  # it ends once the checker's error has ended the scheduler
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_session(proc)
    log = log_path.read_text()
    # the scheduler's strict idle checker raised on the slots the broken free left behind, and the engine's
    # process watch saw the scheduler end
    assert LEAK_REPORT in log and "the SGLang engine's process scheduler_0 (pid " in log, log[-3000:]


def test_forced_retraction_spares_compressed_requests_resumes_the_others_and_keeps_the_radix_tree_exact(
        tiny_model_dir, hf_model):
    """SGLang retracts the running request with the shortest output (ties: the longest prompt) every few
    steps; the plugin puts compressed requests last and spares a batch of them only. One engine, radix cache on,
    the plugin's table checks on. Phase 1: requests are retracted before their first compression and resume; none
    after it (before issue 25 item 4 they were refused and resubmitted). Phase 2: request A (the longer prompt) is
    the retraction victim while B runs (B keeps the batch at two); A is re-prefilled (prompt + response so far),
    then compressed. SGLang checkpoints that re-prefill into the tree: before issue 25 the tree took A's response
    slots, which A's first compression then overwrote with kept K/V, so a later prefill of A's sequence read the
    wrong K/V. Now only the prompt goes into the tree: phase 3's dense prefill of A's sequence is exact."""
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    compression = CompressionConfig(**RKV)
    late = CompressionConfig(method="rkv", budget=12, window=2, buffer=4)
    config = SGLangEngineConfig(model_path=str(tiny_model_dir), compression=late, dtype="float32",
                                max_total_tokens=512, max_resubmits=30, kept_digest=True, check_tables=True)
    with scheduler_env(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL="4"):
        engine = SGLangRolloutEngine(config)
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
        samples = engine.generate([[5, 17, 42], [300, 12, 8, 77]], 3, sampling, compression=compression)
        assert engine.resubmitted == 0                       # no request was retracted after a compression
        assert any(s.metadata["retractions"] >= 1 for s in samples)   # but some were before it, and resumed
        assert_matches_reference(samples, teacher_forced(hf_model, compression, samples), hf_model)
        engine.client.flush_cache()  # phase 2 starts from an empty tree (phase 1's prompts are not A's)
        prompts = [list(range(100, 108)), [5, 17, 42]]
        params = [engine._sampling(sampling, g, 0, 0, late) for g in range(2)]
        params[1]["max_new_tokens"] = 6
        outs = engine.client.generate(prompts, params)
        a = engine._sample(outs[0], prompts[0], prompts[0], 0, 0, sampling)
        # phase 3: a dense request on A's prompt and response so far: its prefill reuses what the tree holds
        context = a.prompt_ids + a.response_ids[:16]
        probe = engine.generate([context], 1, SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True),
                                compression=CompressionConfig())[0]
    finally:
        engine.shutdown()
    assert a.metadata["retractions"] >= 1 and a.compression.events >= 1    # retracted, re-prefilled, compressed
    assert_matches_reference([a], teacher_forced(hf_model, late, [a]), hf_model)
    reference = full_forward_logprobs(hf_model, context, probe.response_ids)
    assert_logprobs_match(probe.sampler_logprobs, reference, hf_model, context, probe.response_ids,
                          "radix_prefill_vs_forward")
