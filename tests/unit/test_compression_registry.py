"""A compressor's registration declares what it needs; the engines and the plugin's checks follow it."""
import pytest
import torch

from sglang_ext.config import SparseKVConfig, supported_methods
from sparse_rl_megatron.compression import CompressionConfig, ScoreInputs
from sparse_rl_megatron.compression.scorers import (
    QUERY_WINDOW, SCORERS, Scorer, compressor_names, methods_help, register_scorer,
)


@pytest.fixture
def oldest_first():
    """Registers ``oldest_first`` (keeps the oldest candidates; needs the query window) for one test."""

    def score(inputs: ScoreInputs, config: CompressionConfig) -> torch.Tensor:
        n, hkv, length, _ = inputs.keys.shape
        return -torch.arange(length - config.window, dtype=torch.float32).expand(n, hkv, -1)

    register_scorer(Scorer("oldest_first", score, "the oldest tokens", needs=frozenset({QUERY_WINDOW})))
    yield "oldest_first"
    del SCORERS._items["oldest_first"]


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="KV compression method 'rkv' is already registered"):
        register_scorer(Scorer("rkv", None))


def test_an_input_no_engine_knows_is_refused():
    with pytest.raises(ValueError, match="needs unknown inputs \\['attention_entropy'\\]"):
        Scorer("x", None, needs=frozenset({"attention_entropy"}))


def test_the_plugin_serves_what_its_inputs_allow():
    assert "h2o" not in supported_methods() and "triattention" in supported_methods()
    with pytest.raises(ValueError, match="'h2o' is not supported by the SGLang plugin .it needs per-step attention"):
        SparseKVConfig(compression=CompressionConfig(method="h2o", budget=8, window=2))


def test_a_new_scorer_is_everywhere_its_registration_says(oldest_first):
    assert oldest_first in compressor_names() and oldest_first in methods_help()
    assert oldest_first in supported_methods()
    config = SparseKVConfig(compression=CompressionConfig(method=oldest_first, budget=8, window=2))
    inputs = ScoreInputs(keys=torch.zeros(1, 2, 10, 4), values=torch.zeros(1, 2, 10, 4))
    with pytest.raises(ValueError, match=f"scorer '{oldest_first}' needs ScoreInputs.queries .query_window."):
        SCORERS.get(oldest_first)(inputs, config.compression)
    inputs.queries = torch.zeros(1, 2, 2, 4)
    assert SCORERS.get(oldest_first)(inputs, config.compression)[0, 0].tolist() == [0.0, -1, -2, -3, -4, -5, -6, -7]
