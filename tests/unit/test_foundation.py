"""The skeleton every other piece builds on: registries, the Sample type, sampling params, tiny models, CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.sample import CompressionInfo, Sample
from sparse_rl_megatron.utils.registry import Registry, UnknownNameError
from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer


def test_registry_lists_valid_names_and_refuses_duplicates():
    reg: Registry[int] = Registry("widget")
    reg.add("b", 2)
    reg.register("a")(1)
    assert reg.get("a") == 1 and reg.names() == ["a", "b"] and "b" in reg
    with pytest.raises(UnknownNameError, match=r"unknown widget 'c'; valid names: a, b"):
        reg.get("c")
    with pytest.raises(ValueError, match=r"cfg\.kind: unknown widget 'zz'; valid names: a, b"):
        reg.check("zz", field="cfg.kind")
    with pytest.raises(ValueError, match="already registered"):
        reg.add("a", 3)


def test_sample_round_trips_through_dict_and_checks_lengths():
    s = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], sampler_logprobs=torch.tensor([-0.5, -1.0, -2.0]),
               compression=CompressionInfo(method="rkv", budget=8, window=2, buffer=4, events=3, peak_kv_tokens=12),
               weight_version=7, reward=1.0, reward_reason="correct")
    d = s.to_dict()
    assert d["sampler_logprobs"] == [-0.5, -1.0, -2.0] and d["compression"]["events"] == 3
    back = Sample.from_dict(d)
    assert back.response_ids == [3, 4, 5] and back.weight_version == 7 and back.compression.budget == 8
    torch.testing.assert_close(back.sampler_logprobs, s.sampler_logprobs)
    with pytest.raises(ValueError, match="sampler_logprobs has 2 entries but response_ids has 3"):
        Sample(prompt_ids=[1], response_ids=[3, 4, 5], sampler_logprobs=torch.zeros(2))


@pytest.mark.parametrize("field,value,msg", [
    ("temperature", -1.0, "temperature must be >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, "top_k must be >= 0"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
])
def test_sampling_params_refuse_bad_values(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**{field: value})


def test_tiny_tokenizer_round_trips_any_text_and_has_chat_template():
    tok = build_tiny_tokenizer()
    assert len(tok) == 512 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Ünïcode ∑ and \\boxed{\\frac{1}{2}} — 12345"
    assert tok.decode(tok(text)["input_ids"]) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")


def test_tiny_models_are_deterministic_per_seed():
    a, b, c = build_tiny_model(seed=1), build_tiny_model(seed=1), build_tiny_model(seed=2)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        la, lb, lc = (m(ids).logits for m in (a, b, c))
    assert torch.equal(la, lb) and not torch.equal(la, lc)
    assert build_tiny_model("llama").config.model_type == "llama"
    with pytest.raises(ValueError, match="unknown family 'gpt9'; valid: llama, qwen2"):
        build_tiny_model("gpt9")


def test_cli_lists_commands_and_rejects_unknown():
    from sparse_rl_megatron.cli import SUBCOMMANDS, main

    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    out = subprocess.run([sys.executable, "-m", "sparse_rl_megatron.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and all(name in out.stdout for name in SUBCOMMANDS)
