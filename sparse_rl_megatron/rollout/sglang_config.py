"""Typed configuration of the SGLang rollout engine (in-process ``sglang.Engine`` or HTTP servers)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from sparse_rl_megatron.compression import CompressionConfig

WeightSync = Literal["tensor", "distributed", "disk"]
WEIGHT_SYNCS: tuple[str, ...] = get_args(WeightSync)
DistributedBackend = Literal["gloo", "nccl"]
DISTRIBUTED_BACKENDS: tuple[str, ...] = get_args(DistributedBackend)
FLUSH_TIMEOUT_S = 120.0
"""Longest a radix-cache flush after a weight update waits for the engine to go idle. SGLang flushes only an idle
scheduler: a request still queued or running (another client's, one whose abort is not yet processed) defers the
flush, which SGLang retries at every scheduler step until the engine is idle (then it flushes) or this passes (then
the update fails: prompt KV of the old weights would stay in the tree)."""


@dataclass
class SGLangOptions:
    """Options of an SGLang engine that its user chooses (servers or in-process, KV pool, weight sync, ...): the
    ``rollout.sglang`` section of ``sparse-rl train``. The model, its KV compression, dtype and placement are the
    run's (``SGLangEngineConfig`` adds them)."""

    urls: list[str] = field(default_factory=list)
    """Base URLs of running servers (started with ``python -m sglang_ext.launch_server``) or one router; empty =
    start an in-process ``sglang.Engine``."""
    tokenizer_path: str = ""
    """Tokenizer directory ('' = ``model_path``)."""
    kept_digest: bool = False
    """Record a hash of the kept positions of every compression event in each sample's provenance. Off by default:
    it costs a blocking device-to-host copy inside the scheduler's forward on every step where some row compresses
    (the overlap scheduler loses its lead) and ``L x Hkv x (B + W)`` int32 per request row; tests comparing the
    kept positions with the reference engine turn it on."""
    max_total_tokens: int | None = None
    """KV pool size in tokens of the in-process engine (None: SGLang sizes it from ``mem_fraction_static`` on
    GPU; on CPU, where SGLang would claim a large share of RAM, ``sglang_ext.cpu_compat.CPU_DEFAULT_POOL_TOKENS``)."""
    mem_fraction_static: float | None = None
    """Fraction of device memory for weights + KV pool (None: SGLang's default)."""
    max_running_requests: int | None = None
    """Most requests decoding at once (None: SGLang's default on GPU, 2048-4096; on CPU
    ``sglang_ext.cpu_compat.CPU_DEFAULT_RUNNING_REQUESTS``)."""
    memory_saver: bool = False
    """CUDA, in-process: start SGLang with ``enable_memory_saver`` (torch_memory_saver, an SGLang dependency on GPU)
    so ``release_memory`` really frees its KV cache and weights while a colocated learner trains; without it
    release/resume are no-ops (always on CPU)."""
    radix_cache: bool = True
    """Share a GRPO group's prompt KV between its samples (prefilled once)."""
    inner_backend: str = ""
    """Attention kernels under the plugin: '' = torch_native on CPU, triton on CUDA."""
    weight_sync: WeightSync = "tensor"
    """How ``update_weights`` reaches the servers: ``tensor`` (in-process only), ``distributed`` (a process group
    with the servers, any node), ``disk`` (safetensors written to ``weight_sync_dir``, then reloaded)."""
    distributed_backend: DistributedBackend = "gloo"
    """Process-group backend of ``distributed`` sync: ``gloo`` (CPU) or ``nccl`` (GPU)."""
    master_address: str = ""
    """Address the servers use to reach this process for ``distributed`` sync (a routable literal IP; '' = this
    host's address on the route to the first server, so every driving rank gives its own)."""
    master_port: int = 0
    """Port of the ``distributed`` rendezvous (0 = pick a free one)."""
    weight_sync_dir: str = ""
    """Directory for ``disk`` sync, visible to every server."""
    random_seed: int | None = None
    """Seed of the in-process engine's sampler (None: 0; in ``sparse-rl train``, the run's ``seed``). The
    trainer's engine k uses ``random_seed + k``."""
    request_seeds: bool | None = None
    """Send each request a ``sampling_seed`` drawn from ``(SamplingParams.seed, group id, index)``. SGLang honours it
    only where its sampler does (the in-process CPU engine; not the ``sparse_kv`` backend on CUDA, which samples from
    the scheduler's RNG: ``random_seed``). None: on for an in-process engine on CPU, off otherwise."""
    request_timeout_s: float = 3600.0
    """Longest an HTTP call may take."""
    flush_timeout_s: float = FLUSH_TIMEOUT_S
    """Longest the radix-cache flush after a weight update waits for the engine to go idle (``FLUSH_TIMEOUT_S``);
    then the update fails in one line, and the engine samples nothing until a later flush succeeds."""
    startup_timeout_s: float = 900.0
    """Longest to wait for HTTP servers to answer ``/health_generate``."""
    request_retries: int = 3
    """HTTP servers: a call that finds no server (refused, reset, 502-504) is tried this many more times (waiting
    2, 4, 8, ... s), and a server that misses this many + 1 ``/health`` checks in a row while a call waits for it
    has stopped answering; then the call fails with one line naming the server's URL."""
    health_check_s: float = 30.0
    """HTTP servers: while a call waits, each server it waits for is asked ``/health`` this often (and given as
    long to answer)."""
    max_resubmits: int = 3
    """A request refused after a retraction (its compressed KV cannot be rebuilt) is resubmitted as a fresh
    sample up to this many times before ``generate`` fails."""
    stats_path: str = ""
    """In-process engine: the plugin appends pool-usage lines here (tests, benchmarks)."""
    count_host_syncs: bool = False
    """With ``stats_path``: the lines also count the plugin's host syncs per forward (tests)."""
    check_tables: bool = False
    """Tests only: the plugin compares its physical tables with SGLang's rows before every forward and raises on a
    difference (a host sync per forward)."""
    log_level: str = "error"
    """SGLang log level of the in-process engine."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Further ``sglang.Engine`` keyword arguments (in-process only)."""

    def __post_init__(self) -> None:
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"SGLangEngineConfig.weight_sync must be one of {', '.join(WEIGHT_SYNCS)}; "
                             f"got '{self.weight_sync}'")
        if self.urls and self.weight_sync == "tensor":
            raise ValueError("SGLangEngineConfig.weight_sync 'tensor' needs the in-process engine; with urls use "
                             "'distributed' or 'disk'")
        if self.weight_sync == "disk" and not self.weight_sync_dir:
            raise ValueError("SGLangEngineConfig.weight_sync_dir is required for weight_sync 'disk'")
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"SGLangEngineConfig.distributed_backend must be one of "
                             f"{', '.join(DISTRIBUTED_BACKENDS)}; got '{self.distributed_backend}'")
        for name in ("max_resubmits", "request_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"SGLangEngineConfig.{name} is out of range: {getattr(self, name)}")
        if not 0 < self.flush_timeout_s < self.request_timeout_s:
            raise ValueError(f"SGLangEngineConfig.flush_timeout_s must be > 0 seconds and below request_timeout_s "
                             f"({self.request_timeout_s:g}); got {self.flush_timeout_s}")
        if not self.health_check_s > 0:
            raise ValueError(f"SGLangEngineConfig.health_check_s must be > 0 seconds; got {self.health_check_s}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"SGLangEngineConfig.max_total_tokens must be >= 1; got {self.max_total_tokens}")


@dataclass
class SGLangEngineConfig(SGLangOptions):
    """How ``SGLangRolloutEngine`` reaches SGLang and what it asks of it: the ``SGLangOptions`` plus the model, its
    KV compression, dtype and placement (which a run fills in: ``RolloutConfig.engine_build``)."""

    model_path: str = ""
    """HF model directory: the in-process engine loads it; with ``urls`` it gives the tokenizer (and the
    config files for disk sync)."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """KV compression of every request (the in-process server's default; sent per request to HTTP servers)."""
    dtype: str = "auto"
    """Weights and KV dtype of the in-process engine (``auto``, ``float32``, ``bfloat16``, ...)."""
    tp_size: int = 1
    """Tensor parallel size of the in-process engine (with ``urls``: the servers', for ``distributed`` sync)."""
    base_gpu_id: int = 0
    """First GPU of the in-process engine: its TP ranks run on GPUs ``base_gpu_id`` .. ``+ tp_size - 1`` (CUDA)."""

    def __post_init__(self) -> None:
        if not self.urls and not self.model_path:
            raise ValueError("SGLangEngineConfig.model_path is required for an in-process engine (or give urls)")
        super().__post_init__()
        for name in ("tp_size", "base_gpu_id"):
            if getattr(self, name) < (1 if name == "tp_size" else 0):
                raise ValueError(f"SGLangEngineConfig.{name} is out of range: {getattr(self, name)}")
        check_plugin_compression(self.compression)

    @classmethod
    def of(cls, options: SGLangOptions, **run_fields: Any) -> "SGLangEngineConfig":
        """``options`` with what the run fills in (``model_path``, ``compression``, ``dtype``, placement; any option
        may be overridden too, e.g. one server's ``urls``)."""
        return cls(**{**{f.name: getattr(options, f.name) for f in fields(SGLangOptions)}, **run_fields})

    @property
    def takes_payloads(self) -> bool:
        """Whether its weights arrive as buckets serialized once per TP rank (``update_weights_from_payloads``): an
        in-process engine with ``tensor`` sync. The one answer: the run's pool asks it of the build
        (``EngineSpec.payload_sync``) on every rank, the engine before it loads payloads."""
        return not self.urls and self.weight_sync == "tensor"

    def plugin_config(self):
        """The ``sparse_kv`` backend settings of an in-process engine."""
        from sglang_ext.config import SparseKVConfig

        return SparseKVConfig(compression=self.compression, inner_backend=self.inner_backend,
                              kept_digest=self.kept_digest, stats_path=self.stats_path,
                              count_host_syncs=self.count_host_syncs, check_tables=self.check_tables)


def check_plugin_compression(compression: CompressionConfig) -> None:
    """Refuse, in one line, a KV compression the ``sparse_kv`` plugin does not implement (its method, scope, ...)."""
    from sglang_ext.config import SparseKVConfig

    SparseKVConfig(compression=compression)  # the plugin's own restrictions, early and in one line
