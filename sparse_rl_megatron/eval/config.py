"""Typed configuration of a benchmark evaluation: model x benchmarks x inference mode x sampling."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.data.sets import BENCHMARKS
from sparse_rl_megatron.rewards.pool import VerifierPoolConfig
from sparse_rl_megatron.rollout.engine_registry import ENGINE_DTYPES, EngineBuild, EngineDtype
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig


@dataclass
class BenchmarkSettings:
    """Sampling settings that may differ per benchmark (the paper samples AIME24 / AMC23 32 times)."""

    n: int = 1
    """Samples per problem (avg@n and pass@k for k <= n)."""
    max_new_tokens: int = 8192
    """Largest response length."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"BenchmarkSettings.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"BenchmarkSettings.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class EvalConfig:
    """One evaluation run."""

    model: str
    """HF model directory, or a Megatron checkpoint (exported to HF first)."""
    benchmarks: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    """Named sets (``data.DATASETS``) or JSONL/Parquet files."""
    tokenizer: str | None = None
    """Tokenizer directory (default: the model's)."""
    data_root: str | None = None
    """Folder holding the shared data (default ``../shared/data`` or ``$SPARSE_RL_DATA``)."""
    limit: int | None = None
    """Evaluate only the first N problems of each benchmark."""
    input_key: str = "prompt"
    """Prompt field of a benchmark given as a user JSONL/Parquet file."""
    label_key: str = "answer"
    """Gold-answer field of a benchmark given as a user file."""
    template: str = "qwen25_chat"
    """Prompt template name (``data.TEMPLATES``)."""
    engine: str = "hf"
    """Rollout engine name (``rollout.engine_registry.ENGINES``)."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Inference mode: dense (method ``none``) or a compressor at a budget."""
    temperature: float = 0.8
    """Sampling temperature (0 = greedy); the paper evaluates at 0.8."""
    top_p: float = 0.95
    """Nucleus mass; the paper evaluates at 0.95."""
    default: BenchmarkSettings = field(default_factory=BenchmarkSettings)
    """n and max_new_tokens of every benchmark without its own entry in ``per_benchmark``."""
    per_benchmark: dict[str, BenchmarkSettings] = field(default_factory=dict)
    """Per-benchmark n / max_new_tokens."""
    pass_k: list[int] | None = None
    """k values of pass@k (default 1, powers of two, n); values above a benchmark's n are left out."""
    seed: int = 0
    """Sampler seed (same seed, same samples)."""
    dtype: EngineDtype = "float32"
    """Compute dtype of the engine."""
    max_batch_size: int = 64
    """Most sequences the engine decodes together."""
    verifier: VerifierPoolConfig = field(default_factory=VerifierPoolConfig)
    """Answer checking: worker processes and the per-answer time limit."""
    show_progress: bool = True
    """Progress bars while generating."""

    def __post_init__(self) -> None:
        if not self.benchmarks:
            raise ValueError("EvalConfig.benchmarks is empty; valid names: " + ", ".join(BENCHMARKS))
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"EvalConfig.limit must be >= 1 or None (all problems), got {self.limit}")
        if self.temperature < 0:
            raise ValueError(f"EvalConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"EvalConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"EvalConfig.dtype must be one of {', '.join(ENGINE_DTYPES)}, got '{self.dtype}'")
        if self.pass_k is not None and any(k < 1 for k in self.pass_k):
            raise ValueError(f"EvalConfig.pass_k values must be >= 1, got {self.pass_k}")
        unknown = set(self.per_benchmark) - set(self.benchmarks)
        if unknown:
            raise ValueError(f"EvalConfig.per_benchmark names {', '.join(sorted(unknown))}, which are not among "
                             f"the benchmarks being evaluated ({', '.join(self.benchmarks)})")

    def engine_build(self, model_dir: str | Path) -> EngineBuild:
        """What the evaluation's engine is built from (``rollout/engine_registry.py``): the model at ``model_dir``, this
        config's compression, dtype, batch size, tokenizer and seed (``sglang``: an in-process engine)."""
        sglang = None
        if self.engine == "sglang":
            sglang = SGLangEngineConfig(model_path=str(model_dir), tokenizer_path=self.tokenizer or "",
                                        compression=self.compression, dtype=self.dtype,
                                        max_running_requests=self.max_batch_size, random_seed=self.seed)
        return EngineBuild(model_dir=str(model_dir), compression=self.compression, dtype=self.dtype,
                           max_batch_size=self.max_batch_size, show_progress=self.show_progress,
                           tokenizer=self.tokenizer, sglang=sglang)

    def settings(self, benchmark: str) -> BenchmarkSettings:
        return self.per_benchmark.get(benchmark, self.default)

    def mode(self) -> str:
        """Short name of the inference mode: ``dense``, or method, budget B and buffer W, e.g. ``rkv-B512-W128``
        (``-response`` appended for the response-only budget scope)."""
        c = self.compression
        if c.is_dense:
            return "dense"
        return f"{c.method}-B{c.budget}-W{c.buffer}" + ("-response" if c.scope == "response" else "")


PAPER_PRESET = {
    "temperature": 0.8,
    "top_p": 0.95,
    "default": BenchmarkSettings(n=1, max_new_tokens=8192),
    "per_benchmark": {"aime24": BenchmarkSettings(n=32, max_new_tokens=16384),
                      "amc23": BenchmarkSettings(n=32, max_new_tokens=16384)},
}
"""The reference evaluation (``algorithm.md``): T = 0.8, top-p 0.95, 8192 tokens; AIME24 and AMC23 avg@32 at
16384 tokens."""
