"""Token scorers, chosen by name: ``rkv``, ``snapkv``, ``streamingllm``, ``h2o``, ``triattention`` and ``none`` (dense).

A scorer maps :class:`ScoreInputs` (one compression of one layer, for ``n`` sequences) to a score per KV
head for every candidate *before* the observation window: ``[n, Hkv, N - alpha]`` float32, higher = keep.
The selector (``selector.py``) then keeps the top ``B - alpha`` of them plus the alpha window tokens.

Formulas: ``docs/algorithm.md`` (section "KV compression: the operators and their budget"); TriAttention:
``triattention.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from sparse_rl_megatron.compression.attention import window_importance
from sparse_rl_megatron.compression.redundancy import key_redundancy
from sparse_rl_megatron.compression.triattention import triattention_scores
from sparse_rl_megatron.utils.registry import Registry


class ScorerSettings(Protocol):
    """The settings a scorer reads: the fields of ``config.CompressionConfig`` of the same names (which names its
    method from ``SCORERS``: the scorers do not import it, so the two modules do not import each other)."""

    window: int
    pool_kernel: int
    gqa_pooling: str
    similarity_threshold: float
    rkv_lambda: float
    sink_tokens: int
    triattention_max_offset: int


@dataclass
class ScoreInputs:
    """Everything a scorer may read for one compression of one layer (``n`` sequences at once).

    N is the number of candidates (tokens that may be evicted), oldest first, in the order the cache holds
    them; the last alpha of them are the observation window (always kept).
    """

    keys: torch.Tensor
    """[n, Hkv, N, D] post-RoPE keys of the candidates (as HF and SGLang both cache them)."""
    values: torch.Tensor
    """[n, Hkv, N, D] values of the candidates."""
    queries: torch.Tensor | None = None
    """[n, Hq, alpha, D] post-RoPE queries of the alpha most recent tokens of the sequence, oldest first."""
    accumulated_attention: torch.Tensor | None = None
    """[n, Hkv, N] attention mass each candidate received so far (H2O only; see ``attention.attention_mass``)."""
    scaling: float | None = None
    """Attention softmax scale (default head_dim ** -0.5)."""
    query_center: torch.Tensor | None = None
    """[n, Hq, D] mean pre-RoPE query of each query head (TriAttention; ``triattention.center_sums``)."""
    query_abs_center: torch.Tensor | None = None
    """[n, Hq, D / 2] mean modulus of each pre-RoPE query pair ``E |q_f|`` (TriAttention)."""
    query_position: torch.Tensor | None = None
    """[n] long: logical position of the next token, one past the newest cached one (TriAttention)."""
    rope_inv_freq: torch.Tensor | None = None
    """[D / 2] the model's rotary ``inv_freq`` (TriAttention)."""

    @property
    def num_candidates(self) -> int:
        return self.keys.shape[2]


@dataclass(frozen=True)
class Scorer:
    """A named scoring rule and what it needs from the engine."""

    name: str
    fn: Callable[[ScoreInputs, ScorerSettings], torch.Tensor] | None
    """(inputs, config) -> [n, Hkv, N - alpha] float32; None for the dense pass-through."""
    needs_queries: bool = False
    """The engine must keep the post-RoPE queries of the last alpha tokens per layer."""
    needs_accumulated_attention: bool = False
    """The engine must accumulate ``attention_mass`` of every query (prefill and decode) per cached token."""
    needs_query_centers: bool = False
    """The engine must pass the pre-RoPE query centers, the next position and the rotary ``inv_freq``."""

    @property
    def compresses(self) -> bool:
        return self.fn is not None

    def __call__(self, inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
        if self.fn is None:
            raise RuntimeError(f"scorer '{self.name}' is the dense pass-through: it never scores tokens")
        n, hkv, length, _ = inputs.keys.shape
        if length <= config.window:
            raise ValueError(f"{self.name}: {length} candidates, need more than the window ({config.window})")
        if self.needs_queries and inputs.queries is None:
            raise ValueError(f"scorer '{self.name}' needs ScoreInputs.queries (the last alpha queries)")
        if self.needs_accumulated_attention and inputs.accumulated_attention is None:
            raise ValueError(f"scorer '{self.name}' needs ScoreInputs.accumulated_attention")
        if self.needs_query_centers:
            missing = [f for f in CENTER_FIELDS if getattr(inputs, f) is None]
            if missing:
                raise ValueError(f"scorer '{self.name}' needs ScoreInputs.{', '.join(missing)}")
        scores = self.fn(inputs, config)
        expected = (n, hkv, length - config.window)
        if tuple(scores.shape) != expected:
            raise RuntimeError(f"scorer '{self.name}' returned shape {tuple(scores.shape)}, expected {expected}")
        return scores.float()


SCORERS: Registry[Scorer] = Registry("KV compression method")
CENTER_FIELDS = ("query_center", "query_abs_center", "query_position", "rope_inv_freq")


def _importance(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    return window_importance(
        inputs.queries, inputs.keys, window=config.window, pool_kernel=config.pool_kernel,
        gqa_pooling=config.gqa_pooling, scaling=inputs.scaling,
    )


def _rkv(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    """R-KV: ``lambda * importance - (1 - lambda) * redundancy`` (redundancy computed over all N keys)."""
    redundancy = key_redundancy(inputs.keys, threshold=config.similarity_threshold)
    past = inputs.num_candidates - config.window
    return config.rkv_lambda * _importance(inputs, config) - (1.0 - config.rkv_lambda) * redundancy[..., :past]


def _snapkv(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    """SnapKV: the window importance alone."""
    return _importance(inputs, config)


def _streamingllm(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    """StreamingLLM: the first ``sink_tokens`` candidates always win, then recency (newer = higher)."""
    n, hkv, length, _ = inputs.keys.shape
    past = length - config.window
    scores = torch.arange(past, dtype=torch.float32, device=inputs.keys.device).expand(n, hkv, past).clone()
    scores[..., : config.sink_tokens] = float("inf")
    return scores


def _h2o(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    """H2O: accumulated attention mass (heavy hitters); recency is covered by the alpha window."""
    past = inputs.num_candidates - config.window
    return inputs.accumulated_attention[..., :past].float()


def _triattention(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    """TriAttention: trigonometric series of the query centers plus the norm term (``triattention.py``);
    standardised over all N candidates, the window's included, as the authors standardise every evictable token."""
    past = inputs.num_candidates - config.window
    scores = triattention_scores(
        inputs.keys, inputs.query_center, inputs.query_abs_center, inputs.query_position, inputs.rope_inv_freq,
        max_offset=config.triattention_max_offset,
    )
    return scores[..., :past]


SCORERS.add("none", Scorer("none", None))
SCORERS.add("rkv", Scorer("rkv", _rkv, needs_queries=True))
SCORERS.add("snapkv", Scorer("snapkv", _snapkv, needs_queries=True))
SCORERS.add("streamingllm", Scorer("streamingllm", _streamingllm))
SCORERS.add("h2o", Scorer("h2o", _h2o, needs_accumulated_attention=True))
SCORERS.add("triattention", Scorer("triattention", _triattention, needs_query_centers=True))


def get_scorer(name: str) -> Scorer:
    """The scorer registered under ``name`` (unknown names raise, listing the valid ones)."""
    return SCORERS.get(name)
