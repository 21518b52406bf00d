"""Typed configuration of KV-cache compression (shared by the HF reference engine and the SGLang plugin).

Defaults are the Sparse-RL reference settings (``docs/algorithm.md``, "KV compression: the operators and their
budget"): budget B = 512, observation window alpha = 8, buffer W = 128, R-KV lambda = 0.1,
max-pool kernel 7, redundancy threshold 0.5; prompt tokens are eviction candidates (scope ``all``) and
over-budget prompts are not compressed at prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from sparse_rl_megatron.compression.scorers import QUERY_CENTERS, SCORERS, Scorer

DENSE_METHOD = "none"
"""Method name meaning: no compression, the full KV cache is kept."""

Scope = Literal["all", "response"]
SCOPES: tuple[str, ...] = get_args(Scope)
GqaPooling = Literal["max", "mean"]
GQA_POOLINGS: tuple[str, ...] = get_args(GqaPooling)
CenterSource = Literal["online", "file"]
CENTER_SOURCES: tuple[str, ...] = get_args(CenterSource)


@dataclass
class CompressionConfig:
    """How the rollout engine compresses the KV cache (per layer, per KV head)."""

    method: str = DENSE_METHOD
    """Scorer name, one of ``scorers.SCORERS`` (``none``: dense)."""
    budget: int = 512
    """B: KV tokens kept per layer and KV head after each compression (ignored when dense)."""
    window: int = 8
    """alpha: the most recent tokens, always kept; their queries are the scorers' observation window."""
    buffer: int = 128
    """W: compression runs when the retained (candidate) length reaches B + W, back down to B."""
    scope: Scope = "all"
    """Which tokens are eviction candidates: ``all`` (prompt included) or ``response`` (prompt kept whole)."""
    rkv_lambda: float = 0.1
    """R-KV mix: score = lambda * importance - (1 - lambda) * redundancy."""
    similarity_threshold: float = 0.5
    """R-KV: cosine similarity above which two keys count as duplicates."""
    pool_kernel: int = 7
    """R-KV / SnapKV: max-pool kernel along the sequence for the importance (odd; padding kernel // 2)."""
    gqa_pooling: GqaPooling = "max"
    """How the query heads of one GQA group are pooled into their KV head's logits: ``max`` or ``mean``."""
    sink_tokens: int = 4
    """StreamingLLM: the first candidates always kept (attention sinks)."""
    triattention_max_offset: int = 65536
    """TriAttention: the future offsets averaged are 1, 2, 4, ... up to this (the authors' 65536: 17 offsets)."""
    triattention_centers: CenterSource = "online"
    """TriAttention query centers: ``online`` (each sequence's own pre-RoPE queries so far, prompt included, at
    the weights that generate it: never stale) or ``file`` (fixed centers from ``triattention_centers_path``,
    the authors' offline calibration; stale once the weights move)."""
    triattention_centers_path: str = ""
    """TriAttention with ``triattention_centers=file``: a ``torch.save`` of ``rollout.centers.calibrate_centers``."""
    trigger_on_newline: bool = False
    """Also compress (down to B) when the last cached token is a newline and more than B are retained."""
    compress_prefill: bool = False
    """Compress an over-budget prompt (more than B tokens) right after prefill (R-KV does; Sparse-RL does not)."""

    def __post_init__(self) -> None:
        SCORERS.check(self.method, field="CompressionConfig.method")
        if self.scope not in SCOPES:
            raise ValueError(f"CompressionConfig.scope must be one of {', '.join(SCOPES)}; got '{self.scope}'")
        if self.gqa_pooling not in GQA_POOLINGS:
            raise ValueError(
                f"CompressionConfig.gqa_pooling must be one of {', '.join(GQA_POOLINGS)}; got '{self.gqa_pooling}'"
            )
        if self.triattention_centers not in CENTER_SOURCES:
            raise ValueError(f"CompressionConfig.triattention_centers must be one of {', '.join(CENTER_SOURCES)}; "
                             f"got '{self.triattention_centers}'")
        if self.uses_center_file and not self.triattention_centers_path:
            raise ValueError("CompressionConfig.triattention_centers=file needs triattention_centers_path")
        for name in ("budget", "window", "buffer", "pool_kernel", "sink_tokens", "triattention_max_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"CompressionConfig.{name} must be an int; got {value!r}")
        if self.window < 1:
            raise ValueError(f"CompressionConfig.window must be >= 1 (the newest token is always kept); got {self.window}")
        if self.budget <= self.window:
            raise ValueError(
                f"CompressionConfig.budget must be > window (B - alpha >= 1 tokens are chosen by score); "
                f"got budget={self.budget}, window={self.window}"
            )
        if self.triattention_max_offset < 1:
            raise ValueError(f"CompressionConfig.triattention_max_offset must be >= 1; got {self.triattention_max_offset}")
        if self.buffer < 1:
            raise ValueError(f"CompressionConfig.buffer must be >= 1; got {self.buffer}")
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"CompressionConfig.rkv_lambda must be in [0, 1]; got {self.rkv_lambda}")
        if not -1.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(
                f"CompressionConfig.similarity_threshold must be in [-1, 1]; got {self.similarity_threshold}"
            )
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"CompressionConfig.pool_kernel must be odd and >= 1; got {self.pool_kernel}")
        if self.scorer.keeps_sinks and not 0 <= self.sink_tokens <= self.budget - self.window:
            raise ValueError(
                f"CompressionConfig.sink_tokens must be in [0, budget - window = {self.budget - self.window}]; "
                f"got {self.sink_tokens}"
            )
        if self.compress_prefill and self.scope != "all":
            raise ValueError(
                "CompressionConfig.compress_prefill needs scope='all' (scope='response' always keeps the prompt whole)"
            )

    @property
    def scorer(self) -> Scorer:
        """The registered scorer of ``method`` (what it needs and reads)."""
        return SCORERS.get(self.method)

    @property
    def uses_center_file(self) -> bool:
        """The scorer needs query centers and takes them from ``triattention_centers_path``."""
        return QUERY_CENTERS in self.scorer.needs and self.triattention_centers == "file"

    @property
    def is_dense(self) -> bool:
        """True when nothing is ever evicted."""
        return self.method == DENSE_METHOD

    @property
    def max_candidates(self) -> int:
        """B + W: the candidate count that triggers a compression."""
        return self.budget + self.buffer

    def describe(self) -> str:
        """One line for logs."""
        if self.is_dense:
            return "dense (no KV compression)"
        return (
            f"{self.method} B={self.budget} alpha={self.window} W={self.buffer} scope={self.scope}"
            + (" +newline" if self.trigger_on_newline else "")
            + (" +prefill" if self.compress_prefill else "")
        )
