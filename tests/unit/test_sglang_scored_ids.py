"""The SGLang engine's check that a dense scoring pass scored the response's own tokens: SGLang 0.5 reports every
input id >= vocab - 1 as 0 in ``input_token_logprobs`` (its values are still those ids'), and the vocabulary size
is the one SGLang serves, read from the model's text config as SGLang reads it."""
from __future__ import annotations

import json

from sparse_rl_megatron.rollout.sglang_engine import _config_vocab_size, config_vocab_size, scored_ids_match


def test_the_last_vocabulary_id_matches_a_reported_zero_and_nothing_else_does():
    assert scored_ids_match([7, 0, 3], [7, 511, 3], 512)
    assert scored_ids_match([7, 0], [7, 512], 512)        # beyond the vocabulary: clipped the same way
    assert not scored_ids_match([7, 0], [7, 510], 512)     # 510 is reported as itself
    assert not scored_ids_match([7, 3], [7, 4], 512)
    assert not scored_ids_match([7], [7, 511], 512)        # a length mismatch is never a match
    assert scored_ids_match([0, 5], [9, 5], None)           # vocabulary unknown: any reported 0 may be a clip
    assert not scored_ids_match([1, 5], [9, 5], None)


def test_the_vocabulary_size_is_the_text_configs_as_sglang_reads_it(tmp_path):
    assert config_vocab_size({"vocab_size": 151936}) == 151936
    assert config_vocab_size({"vocab_size": 10, "text_config": {"vocab_size": 8}}) == 8
    assert config_vocab_size({"vocab_size": 10, "text_config": None}) == 10
    assert config_vocab_size({"language_config": {"vocab_size": 6}, "text_config": {"vocab_size": 8}}) == 6
    assert config_vocab_size({"thinker_config": {"text_config": {"vocab_size": 4}}, "vocab_size": 9}) == 4
    assert config_vocab_size({"thinker_config": {"vocab_size": 3}}) == 3
    assert config_vocab_size({}) is None
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512}))
    assert _config_vocab_size(str(tmp_path)) == 512
    assert _config_vocab_size("") is None                   # servers given by URL alone: no model directory
    assert _config_vocab_size(str(tmp_path / "missing")) is None
