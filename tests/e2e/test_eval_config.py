"""`sparse-rl eval` arguments -> EvalConfig: the paper preset, explicit flags winning, per-benchmark entries,
engine/template/compression names checked."""
import argparse

import pytest

from sparse_rl_megatron.eval.cli import add_arguments, build_config
from sparse_rl_megatron.rollout.engine_registry import ENGINES
from sparse_rl_megatron.utils.errors import UsageError
from sparse_rl_megatron.utils.registry import UnknownNameError


def _config(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_config(parser.parse_args(["--model", "m", *argv]))


def test_paper_preset_is_the_reference_eval():
    c = _config()
    assert (c.temperature, c.top_p) == (0.8, 0.95)
    assert (c.settings("math500").n, c.settings("math500").max_new_tokens) == (1, 8192)
    assert (c.settings("aime24").n, c.settings("aime24").max_new_tokens) == (32, 16384)
    assert (c.settings("amc23").n, c.settings("amc23").max_new_tokens) == (32, 16384)
    assert c.mode() == "dense" and c.compression.is_dense


def test_explicit_flags_win_over_the_preset_everywhere():
    c = _config("--n", "2", "--max-new-tokens", "64", "--temperature", "0", "--bench", "aime24:n=4")
    assert c.temperature == 0.0 and c.top_p == 0.95
    assert (c.settings("gsm8k").n, c.settings("amc23").n, c.settings("aime24").n) == (2, 2, 4)
    assert c.settings("aime24").max_new_tokens == 64
    none = _config("--preset", "none", "--benchmarks", "gsm8k")
    assert none.per_benchmark == {} and none.settings("gsm8k").n == 1


def test_compression_and_bad_values_are_named():
    c = _config("--compression", "snapkv", "--budget", "256", "--scope", "response")
    assert c.mode() == "snapkv-B256-W128-response" and c.compression.scope == "response"
    with pytest.raises(UsageError, match="--compression: unknown KV compression method 'rkvv'.*rkv"):
        _config("--compression", "rkvv")
    with pytest.raises(UsageError, match="--bench"):
        _config("--bench", "aime24:k=4")
    with pytest.raises(UsageError, match="--bench names gsm8k"):
        _config("--benchmarks", "math500", "--bench", "gsm8k:n=2")
    with pytest.raises(SystemExit):  # argparse: invalid choice
        _config("--dtype", "int8")
    with pytest.raises(UnknownNameError, match="valid names: hf"):
        ENGINES.get("sglang-typo")
