"""SGLang 0.5.x runs on this CPU through sglang_ext.cpu_compat, loads our plugin, and returns log-probs
that match a full HF forward pass of the same tiny model (the contract the compressed-KV plugin builds on)."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from sglang_ext import cpu_compat
from sglang_helpers import assert_logprobs_match
from sparse_rl_megatron.models.tiny import build_tiny_model, save_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    cpu_compat.apply()
    import sglang as sgl

    model_dir = save_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3, init_std=0.2)
    trace = tmp_path_factory.mktemp("trace") / "plugin.txt"
    os.environ["SPARSE_RL_PLUGIN_TRACE"] = str(trace)
    kwargs = cpu_compat.cpu_engine_kwargs() if not torch.cuda.is_available() else {}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGQUIT)}
    engine = sgl.Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=2048,
                        disable_radix_cache=True, random_seed=0, log_level="error", **kwargs)
    # SGLang's bare engine installs its SIGTERM handler at the first request: here, not inside a test
    engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 1})
    yield engine, build_tiny_model(seed=3, init_std=0.2), trace
    engine.shutdown()
    os.environ.pop("SPARSE_RL_PLUGIN_TRACE", None)
    for s, h in handlers.items():
        signal.signal(s, h)


def test_plugin_is_loaded_in_the_scheduler_process(engine_and_model):
    _, _, trace = engine_and_model
    lines = trace.read_text().splitlines()
    assert any(int(line.split()[0]) != os.getpid() for line in lines), lines


def test_logprobs_match_hf_full_forward(engine_and_model):
    engine, model, _ = engine_and_model
    prompts = [[5, 17, 42, 99, 7], [300, 12, 8]]
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 1.0, "max_new_tokens": 12,
                                                                "ignore_eos": True}, return_logprob=True)
    for prompt, out in zip(prompts, outs):
        triples = out["meta_info"]["output_token_logprobs"]
        response = [tok for _, tok, _ in triples]
        assert len(response) == 12
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        expected = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None])[:, 0]
        got = torch.tensor([lp for lp, _, _ in triples])
        assert_logprobs_match(got, expected, model, prompt, response, "bare_engine_vs_forward")
