"""Token scorers, chosen by name from ``SCORERS`` (``register_scorer``): each declares what it needs.

A scorer maps :class:`ScoreInputs` (one compression of one layer, for ``n`` sequences) to a score per KV
head for every candidate *before* the observation window: ``[n, Hkv, N - alpha]`` float32, higher = keep.
The selector (``selector.py``) then keeps the top ``B - alpha`` of them plus the alpha window tokens.

Formulas: ``docs/algorithm.md`` (section "KV compression: the operators and their budget"); TriAttention:
``triattention.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from sparse_rl_megatron.utils.registry import Registry

if TYPE_CHECKING:  # torch and the scoring modules load with the first score, so a CLI's --help can list the
    import torch   # registered methods without importing torch (tests/e2e/test_cli_startup.py)


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


QUERY_WINDOW = "query_window"
"""Input: the post-RoPE queries of the last alpha tokens per layer (``ScoreInputs.queries``)."""
ACCUMULATED_ATTENTION = "accumulated_attention"
"""Input: ``attention_mass`` of every query so far (prefill and decode) per cached token."""
QUERY_CENTERS = "query_centers"
"""Input: the pre-RoPE query centers, the next position and the rotary ``inv_freq`` (``CENTER_FIELDS``)."""
CENTER_FIELDS = ("query_center", "query_abs_center", "query_position", "rope_inv_freq")
INPUT_FIELDS: dict[str, tuple[str, ...]] = {
    QUERY_WINDOW: ("queries",),
    ACCUMULATED_ATTENTION: ("accumulated_attention",),
    QUERY_CENTERS: CENTER_FIELDS,
}
"""Every input a scorer may declare it needs beyond the keys and values, and the ``ScoreInputs`` fields it fills.
An engine says which of these it provides (``rollout/kv_cache.PROVIDES``, ``sglang_ext/config.PLUGIN_PROVIDES``);
a scorer runs on an engine that provides all it needs."""


@dataclass(frozen=True)
class Scorer:
    """A named scoring rule and what it declares: the inputs it needs, the knobs it reads, its cost."""

    name: str
    fn: Callable[[ScoreInputs, ScorerSettings], torch.Tensor] | None
    """(inputs, config) -> [n, Hkv, N - alpha] float32; None for the dense pass-through."""
    summary: str = ""
    """One line: what the score is (the docs' table of methods and the CLIs' help show it)."""
    needs: frozenset[str] = frozenset()
    """Inputs the engine must provide, keys of ``INPUT_FIELDS``."""
    pairwise: bool = False
    """The score compares every pair of candidates (an N x N float32 scratch per KV head: chunk sizing)."""
    keeps_sinks: bool = False
    """The first ``config.sink_tokens`` candidates always win (the budget must leave room for them)."""

    def __post_init__(self) -> None:
        unknown = sorted(self.needs - INPUT_FIELDS.keys())
        if unknown:
            raise ValueError(f"scorer '{self.name}' needs unknown inputs {unknown}; known: {sorted(INPUT_FIELDS)}")

    def runs_with(self, provided: frozenset[str] | set[str]) -> bool:
        """Whether an engine providing the inputs ``provided`` can run this scorer."""
        return self.needs <= provided

    @property
    def compresses(self) -> bool:
        return self.fn is not None

    def __call__(self, inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
        if self.fn is None:
            raise RuntimeError(f"scorer '{self.name}' is the dense pass-through: it never scores tokens")
        n, hkv, length, _ = inputs.keys.shape
        if length <= config.window:
            raise ValueError(f"{self.name}: {length} candidates, need more than the window ({config.window})")
        for need in sorted(self.needs):
            missing = [f for f in INPUT_FIELDS[need] if getattr(inputs, f) is None]
            if missing:
                raise ValueError(f"scorer '{self.name}' needs ScoreInputs.{', '.join(missing)} ({need})")
        scores = self.fn(inputs, config)
        expected = (n, hkv, length - config.window)
        if tuple(scores.shape) != expected:
            raise RuntimeError(f"scorer '{self.name}' returned shape {tuple(scores.shape)}, expected {expected}")
        return scores.float()


SCORERS: Registry[Scorer] = Registry("KV compression method")


def register_scorer(scorer: Scorer) -> Scorer:
    """Register ``scorer`` under its name (a second registration of a name is refused)."""
    SCORERS.add(scorer.name, scorer)
    return scorer


def _importance(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    from sparse_rl_megatron.compression.attention import window_importance

    return window_importance(
        inputs.queries, inputs.keys, window=config.window, pool_kernel=config.pool_kernel,
        gqa_pooling=config.gqa_pooling, scaling=inputs.scaling,
    )


def _rkv(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    """R-KV: ``lambda * importance - (1 - lambda) * redundancy`` (redundancy computed over all N keys)."""
    from sparse_rl_megatron.compression.redundancy import key_redundancy

    redundancy = key_redundancy(inputs.keys, threshold=config.similarity_threshold)
    past = inputs.num_candidates - config.window
    return config.rkv_lambda * _importance(inputs, config) - (1.0 - config.rkv_lambda) * redundancy[..., :past]


def _snapkv(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    """SnapKV: the window importance alone."""
    return _importance(inputs, config)


def _streamingllm(inputs: ScoreInputs, config: ScorerSettings) -> torch.Tensor:
    """StreamingLLM: the first ``sink_tokens`` candidates always win, then recency (newer = higher)."""
    import torch

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
    from sparse_rl_megatron.compression.triattention import triattention_scores

    past = inputs.num_candidates - config.window
    scores = triattention_scores(
        inputs.keys, inputs.query_center, inputs.query_abs_center, inputs.query_position, inputs.rope_inv_freq,
        max_offset=config.triattention_max_offset,
    )
    return scores[..., :past]


register_scorer(Scorer("none", None, "dense: nothing is compressed"))
register_scorer(Scorer("rkv", _rkv, "R-KV: window attention importance minus key redundancy",
                       needs=frozenset({QUERY_WINDOW}), pairwise=True))
register_scorer(Scorer("snapkv", _snapkv, "SnapKV: window attention importance", needs=frozenset({QUERY_WINDOW})))
register_scorer(Scorer("streamingllm", _streamingllm, "StreamingLLM: attention sinks, then the most recent tokens",
                       keeps_sinks=True))
register_scorer(Scorer("h2o", _h2o, "H2O: attention mass accumulated over every query (heavy hitters)",
                       needs=frozenset({ACCUMULATED_ATTENTION})))
register_scorer(Scorer("triattention", _triattention, "TriAttention: trigonometric series of the pre-RoPE query "
                       "centers plus a norm term", needs=frozenset({QUERY_CENTERS})))


def get_scorer(name: str) -> Scorer:
    """The scorer registered under ``name`` (unknown names raise, listing the valid ones)."""
    return SCORERS.get(name)


def compressor_names() -> list[str]:
    """The registered scorers that compress (every one but the dense pass-through)."""
    return [n for n in SCORERS.names() if SCORERS.get(n).compresses]


def methods_help(dense: bool = True) -> str:
    """``none (dense), h2o, rkv, ...``: the method names for a CLI's help, from the registry."""
    return ", ".join(([f"{n} (dense)" for n in SCORERS.names() if not SCORERS.get(n).compresses] if dense else [])
                     + compressor_names())
