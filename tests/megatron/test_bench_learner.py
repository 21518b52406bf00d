"""bench/bench_learner.py on a GPU machine: only the layouts that fit the visible GPUs run (the others are
skipped and said so, instead of a rank asking for a device that is not there), and MFU counts the FLOPs as
computed (``learner/flops.py``: the LM head on response tokens only, causal attention included)."""
import importlib.util

import pytest
import torch

from mcore_harness import ROOT

from sparse_rl_megatron.learner.flops import forward_flops, train_step_flops
from sparse_rl_megatron.models.arch import ModelArch


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_learner", ROOT / "bench" / "bench_learner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layouts_that_do_not_fit_the_gpus_are_skipped(bench):
    assert bench.runnable_layouts(["1x1", "2x1", "1x2"], None) == (["1x1", "2x1", "1x2"], [])  # CPU: processes
    assert bench.runnable_layouts(["1x1", "2x1", "1x2", "2x2"], 2) == (["1x1", "2x1", "1x2"],
                                                                        ["2x2 (needs 4 GPUs, 2 visible)"])


def test_one_gpu_machine_runs_what_fits_and_says_what_it_skipped(bench, monkeypatch, capsys):
    """The driver on a machine reporting one GPU: TP2 and PP2 are not launched (a torchrun of 2 ranks would
    ask for device 1), the output names them, and the run ends without a table instead of crashing."""
    launched = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench, "_run", lambda cmd: launched.append(cmd) or {})
    assert bench.main(["--layouts", "2x1", "1x2", "--skip-memory"]) == 0
    out = capsys.readouterr().out
    assert launched == []
    assert "skipped 2x1 (needs 2 GPUs, 1 visible)" in out and "skipped 1x2 (needs 2 GPUs, 1 visible)" in out
    assert "no layout fits the visible GPUs" in out


def _arch(**kw) -> ModelArch:
    base = dict(family="qwen2", vocab_size=100, hidden_size=8, num_layers=2, num_attention_heads=4,
                num_query_groups=2, head_dim=2, ffn_hidden_size=16, max_position_embeddings=64, norm_eps=1e-6,
                rope_theta=1e4, qkv_bias=True, tie_word_embeddings=True, hf_dtype="float32")
    return ModelArch(**{**base, **kw})


def test_flops_count_the_head_on_scored_tokens_and_causal_attention():
    a = _arch()
    # per fed token and layer: 2 * (qkv 8 * (8 + 2 * 4) + out 8 * 8 + mlp 3 * 8 * 16) = 2 * 576 = 1152
    # attention, rows of 3 and 2 tokens: (1 + 2 + 3) + (1 + 2) = 9 causal pairs, 2 * 2 * q(8) = 32 each
    # head: 2 * 100 * 8 = 1600 per scored token
    assert forward_flops(a, [3, 2], scored_tokens=4) == 2 * (1152 * 5 + 32 * 9) + 1600 * 4
    assert forward_flops(a, [3, 2], scored_tokens=0) == 2 * (1152 * 5 + 32 * 9)
    assert train_step_flops(a, [3, 2], 4) == 3 * forward_flops(a, [3, 2], 4)


def test_bench_default_batch_counts_the_head_on_response_tokens(bench):
    """At the bench's defaults (16 rows x (64 prompt + 192 response)) the head runs on 3072 of the 4080 fed
    tokens: counting it on every fed token overstated the FLOPs without attention by 11%."""
    args = bench.parse_args([])
    a = _arch(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
              num_attention_heads=args.heads, num_query_groups=args.kv_heads, head_dim=args.hidden // args.heads,
              ffn_hidden_size=args.intermediate)
    seqs = bench.random_batch(args.rows, args.prompt_len, args.response_len, args.vocab)
    fed, scored = seqs.lengths, int(seqs.response_mask().sum())
    assert (sum(fed), scored) == (4080, 3072)
    head = 2 * args.vocab * args.hidden
    assert forward_flops(a, fed, scored) - forward_flops(a, fed, 0) == head * scored
    attention = 2 * 2 * args.layers * args.hidden * sum(n * (n + 1) // 2 for n in fed)
    without_attention = forward_flops(a, fed, scored) - attention
    assert (without_attention + head * (sum(fed) - scored)) / without_attention == pytest.approx(1.113, abs=1e-3)
