"""One compression of one layer: score the candidates, then select B per KV head."""
from __future__ import annotations

import torch

from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.compression.scorers import ScoreInputs, get_scorer
from sparse_rl_megatron.compression.selector import select_kept


def choose_kept(config: CompressionConfig, inputs: ScoreInputs) -> torch.Tensor:
    """[n, Hkv, B] ascending candidate indices to keep (see ``selector.select_kept``)."""
    scores = get_scorer(config.method)(inputs, config)
    return select_kept(scores, budget=config.budget, window=config.window)
