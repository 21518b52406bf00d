"""What a plan is computed from: the layout, the batch shape, the learner and rollout settings.

Every field is validated on construction with one line naming the command-line option and the valid values.
"""
from __future__ import annotations

from dataclasses import dataclass
from sparse_rl_megatron.planning.activations import KERNELS

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GIB = 2 ** 30


def _positive(**values: float) -> None:
    for option, value in values.items():
        if not value > 0:
            raise ValueError(f"--{option.replace('_', '-')} must be > 0, got {value}")


@dataclass(frozen=True)
class Layout:
    """Where the learner runs: TP x PP x DP GPUs of ``gpu_memory_gib`` each, ``gpus_per_node`` per node; a mixture of
    experts' routed experts split over EP x expert-TP of the TP x DP ranks of each stage."""

    tp: int
    """Tensor-parallel size (``--tp``)."""
    pp: int
    """Pipeline-parallel size (``--pp``)."""
    dp: int
    """Data-parallel size (``--dp``); the job has tp * pp * dp GPUs."""
    gpus_per_node: int = 8
    """GPUs per node (``--gpus-per-node``): TP stays inside a node."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU in GiB (``--gpu-memory``)."""
    ep: int = 1
    """Expert-parallel size (``--ep``): a mixture of experts' routed experts split over this many ranks."""
    etp: int | None = None
    """Expert tensor-parallel size (``--etp``); None: the TP size (as the learner)."""

    def __post_init__(self) -> None:
        _positive(tp=self.tp, pp=self.pp, dp=self.dp, gpus_per_node=self.gpus_per_node, gpu_memory=self.gpu_memory_gib,
                  ep=self.ep, etp=self.expert_tp)
        if self.tp > self.gpus_per_node:
            raise ValueError(f"--tp {self.tp} exceeds --gpus-per-node {self.gpus_per_node}: tensor parallelism "
                             f"across nodes is not planned; valid --tp values are at most {self.gpus_per_node}")
        if (self.tp * self.dp) % (self.ep * self.expert_tp):
            raise ValueError(f"--ep {self.ep} x --etp {self.expert_tp} does not divide the TP x DP = "
                             f"{self.tp * self.dp} GPUs of a pipeline stage")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: the stage's GPUs over EP x expert TP (the distributed optimizer's shards of
        the routed experts)."""
        return self.tp * self.dp // (self.ep * self.expert_tp)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        experts = f" (EP{self.ep} x ETP{self.expert_tp})" if self.ep > 1 or self.etp is not None else ""
        return f"TP{self.tp} x PP{self.pp} x DP{self.dp}{experts} = {self.gpus} GPUs of {self.gpu_memory_gib:g} GiB"


@dataclass(frozen=True)
class BatchShape:
    """One RL step: ``prompts`` x ``samples`` rollouts of ``prompt_len`` + ``response_len`` tokens."""

    prompts: int
    """Prompts per step (``--prompts``)."""
    samples: int
    """Responses per prompt, the GRPO group size (``--samples``)."""
    prompt_len: int
    """Prompt tokens (``--prompt-len``)."""
    response_len: int
    """Response tokens, the planned maximum (``--response-len``)."""

    def __post_init__(self) -> None:
        _positive(prompts=self.prompts, samples=self.samples, prompt_len=self.prompt_len, response_len=self.response_len)

    @property
    def rollouts(self) -> int:
        return self.prompts * self.samples

    @property
    def fed_tokens(self) -> int:
        """Tokens of one row fed to the learner (the last response token is scored but never fed)."""
        return self.prompt_len + self.response_len - 1


@dataclass(frozen=True)
class LearnerSetting:
    """How the megatron-core learner trains (the ``LearnerConfig`` / ``OptimConfig`` choices that cost memory)."""

    params_dtype: str = "bfloat16"
    """Parameter and activation dtype (``--params-dtype``): bfloat16 (GPU) or float32 (the CPU learner)."""
    distributed_optimizer: bool = True
    """Shard the fp32 master weights and Adam moments over DP (``--no-distributed-optimizer`` turns it off)."""
    recompute: bool = False
    """Full activation recompute, one layer per checkpoint (``--recompute full``)."""
    kernels: str = "fused"
    """Layer implementation (``--kernels``): fused (Transformer Engine, flash attention) or local (megatron-core's
    own modules: unfused attention that keeps [heads, s, s] probabilities; the CPU learner)."""
    max_tokens_per_device: int = 16384
    """Token budget of one micro-batch (``--max-tokens-per-device``)."""
    logprob_chunk_tokens: int = 512
    """Scored tokens per LM-head chunk, 0 = unchunked (``--logprob-chunk``)."""
    reference_model: bool = False
    """A frozen KL reference policy sits next to the learner (``--kl-reference``)."""
    offload: str = "none"
    """What of the learner sleeps while the colocated engines decode (``--offload``, ``learner.offload``: a name of
    ``learner.offload.OFFLOAD_MODES``)."""

    def __post_init__(self) -> None:
        from sparse_rl_megatron.learner.offload import OFFLOAD_MODES

        OFFLOAD_MODES.check(self.offload, "--offload")
        if self.params_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"--params-dtype must be bfloat16 or float32, got {self.params_dtype!r}")
        KERNELS.check(self.kernels, "--kernels")
        _positive(max_tokens_per_device=self.max_tokens_per_device)
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"--logprob-chunk must be >= 0 (0 = unchunked), got {self.logprob_chunk_tokens}")

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]


@dataclass(frozen=True)
class RolloutSetting:
    """The rollout engine's KV cache: tensor parallelism, KV dtype and how much memory the KV pool gets."""

    tp: int = 1
    """Rollout engine tensor-parallel size (``--rollout-tp``)."""
    kv_dtype: str = "bfloat16"
    """KV cache dtype (``--kv-dtype``)."""
    mem_fraction: float = 0.85
    """Share of a GPU the engine takes for weights + KV pool (``--mem-fraction``, SGLang's mem_fraction_static)."""
    kv_pool_gib: float | None = None
    """KV pool per GPU in GiB (``--kv-pool``); default: mem_fraction x GPU memory - the engine's weights."""
    max_running_requests: int | None = None
    """Request rows of an SGLang engine (``--max-running-requests``; None: SGLang's default, at most 4096); the
    sparse_kv plugin's memory scales with them."""
    kept_digest: bool = False
    """The sparse_kv plugin keeps kept-position tables for the samples' digests (off: the SGLang engine's default)."""
    memory_saver: bool = True
    """SGLang's memory saver (``rollout.sglang.memory_saver``): the released engine frees its weights and KV pool
    while the learner trains (``--no-memory-saver``: it keeps them)."""
    bucket_mb: int = 512
    """Weight-sync bucket in MiB (``--bucket-mb``, ``sync.bucket_mb``)."""

    def __post_init__(self) -> None:
        _positive(rollout_tp=self.tp, bucket_mb=self.bucket_mb)
        if self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.kv_dtype!r}")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}")
        if self.kv_pool_gib is not None:
            _positive(kv_pool=self.kv_pool_gib)
        if self.max_running_requests is not None:
            _positive(max_running_requests=self.max_running_requests)
