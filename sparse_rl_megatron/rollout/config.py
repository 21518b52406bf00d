"""The ``rollout`` section of ``sparse-rl train`` and its one translation into what an engine is built from.

``RolloutConfig`` lives beside the engines it describes: ``engine_build`` turns it (with what the run owns: the
exported model, the run's seed, the engine's place in the layout) into the ``EngineBuild`` the engine registry
builds from (``engine_registry.py``); an ``sglang`` engine's ``SGLangEngineConfig`` is its ``SGLangOptions`` plus those
(``SGLangEngineConfig.of``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparse_rl_megatron.compression.budget_controller import AdaptiveBudgetConfig
from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.engine_registry import ENGINE_DTYPES, EngineBuild, EngineDtype
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig, SGLangOptions, check_plugin_compression

if TYPE_CHECKING:
    from sparse_rl_megatron.rollout.layout import EngineSlot


@dataclass
class PartialRolloutConfig:
    """Partial rollouts (``rollout.partial``): a step trains on the first ``prompts_per_step`` whole GRPO groups that
    finish; unfinished responses are carried into the next step and continued under the new weights
    (``trainer/partial_rollouts.py``, ``docs/algorithm.md`` "Partial rollouts")."""

    enabled: bool = False
    """Off: every step samples its groups to the end (synchronous rollouts)."""
    extra_groups: int = 4
    """Groups in flight beyond ``prompts_per_step`` (over-provisioning: the slow groups of a step wait for the next)."""
    segment_tokens: int = 32
    """Most tokens a response gains per engine call; a step runs calls until enough whole groups have finished, and a
    response still running at the step's end is carried (continued by re-prefilling prompt + response so far)."""
    max_staleness: int = 1
    """Largest lag, in weight versions, of a token at training time (a group holding an older token is dropped and
    counted: ``rollout/partial/dropped_groups``)."""

    def __post_init__(self) -> None:
        for name, low in (("extra_groups", 0), ("segment_tokens", 1), ("max_staleness", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"RolloutConfig.partial.{name} must be >= {low}, got {getattr(self, name)}")


@dataclass
class RolloutConfig:
    """How responses are sampled (the sparse sampler pi_sparse)."""

    engine: str = "hf"
    """Rollout engine (``rollout.engine_registry.ENGINES``): ``hf`` (reference engine, in its rank's process) or ``sglang``
    (SGLang with the sparse_kv plugin, in-process in its rank or HTTP servers; options in ``sglang``)."""
    gpus_per_engine: int = 1
    """GPUs (ranks) per rollout engine: one engine per group of this many ranks on every node, in the group's
    first rank, on the group's GPUs (SGLang's tensor-parallel size); with ``sglang.urls`` the servers' TP size."""
    prompts_per_step: int = 4
    """GRPO groups (prompts) per rollout step."""
    samples_per_prompt: int = 4
    """GRPO group size n (samples per prompt)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling of training responses (temperature 1 as in the reference runs; the seed is set per step)."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """KV compression while sampling; method ``none`` is a dense rollout."""
    adaptive_budget: AdaptiveBudgetConfig = field(default_factory=AdaptiveBudgetConfig)
    """Adapt ``compression.budget`` each step to hold a mismatch signal at a target (``enabled: true``); an ``sglang``
    engine's servers are sized for ``max_budget`` and each request carries the step's budget."""
    dtype: EngineDtype = "float32"
    """Compute dtype of the engine (float32 on CPU; bfloat16 on GPUs)."""
    max_batch_size: int = 64
    """Most sequences the ``hf`` engine decodes together (``sglang``: ``sglang.max_running_requests``)."""
    sglang: SGLangOptions = field(default_factory=SGLangOptions)
    """Options of the ``sglang`` engine (servers or in-process, KV pool, weight sync, ...); only with that engine."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Options of an engine registered by a plugin; the built-in engines take none."""
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    """Partial rollouts across weight versions (off by default): the long tail no longer sets the step time."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "max_batch_size", "gpus_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"RolloutConfig.dtype must be one of {', '.join(ENGINE_DTYPES)}, got '{self.dtype}'")
        self._check_adaptive_budget()
        if self.partial.enabled and self.engine == "sglang":  # what a continued (re-prefilled) request cannot hold
            if not self.compression.is_dense and self.compression.scope == "response":
                raise ValueError("rollout.partial.enabled with engine sglang needs compression.scope: all (a carried "
                                 "response is re-prefilled, and the plugin counts re-prefilled tokens as prompt); "
                                 "valid: scope all, or engine hf")
            if self.sampling.stop:
                raise ValueError("rollout.partial.enabled with engine sglang needs rollout.sampling.stop empty "
                                 "(SGLang matches stop strings on a continued request's new text only); valid: no "
                                 "stop strings, or engine hf")
        if self.engine == "sglang":  # the plugin's limits on the compression (method, scope, ...) checked now
            check_plugin_compression(self.server_compression())
        elif self.sglang != SGLangOptions():
            raise ValueError(f"sglang options are set, but engine is '{self.engine}' (they apply to engine sglang)")

    def _check_adaptive_budget(self) -> None:
        adaptive, c = self.adaptive_budget, self.compression
        if not adaptive.enabled:
            return
        if c.is_dense:
            raise ValueError("adaptive_budget.enabled needs a compressing compression.method (it is 'none': dense)")
        if not adaptive.min_budget <= c.budget <= adaptive.max_budget:
            raise ValueError(f"compression.budget ({c.budget}) is the adaptive budget's start and must be within "
                             f"[adaptive_budget.min_budget, max_budget] = [{adaptive.min_budget}, {adaptive.max_budget}]")
        if adaptive.min_budget <= c.window:
            raise ValueError(f"adaptive_budget.min_budget ({adaptive.min_budget}) must be > compression.window "
                             f"({c.window})")
        if c.scorer.keeps_sinks and adaptive.min_budget - c.window < c.sink_tokens:
            raise ValueError(f"adaptive_budget.min_budget ({adaptive.min_budget}) must leave room for "
                             f"compression.sink_tokens ({c.sink_tokens}) besides the window ({c.window})")

    def budget_compression(self, budget: int | None) -> CompressionConfig:
        """``compression`` with ``budget`` as its budget (None: as configured)."""
        return self.compression if budget is None else dataclasses.replace(self.compression, budget=budget)

    def sglang_config(self, model_path: str, *, base_gpu_id: int = 0, urls: list[str] | None = None
                      ) -> SGLangEngineConfig:
        """The ``SGLangEngineConfig`` of an ``sglang`` engine serving the model at ``model_path``: in process on
        ``gpus_per_engine`` GPUs from ``base_gpu_id``, or the servers ``urls`` (default: all of ``sglang.urls``).
        With the adaptive budget the server's compression has ``max_budget`` (it bounds the per-request budgets and
        sizes the plugin's tables); every step's requests carry their own budget, which admission reserves for."""
        return SGLangEngineConfig.of(self.sglang, model_path=model_path, compression=self.server_compression(),
                                     dtype=self.dtype, tp_size=self.gpus_per_engine, base_gpu_id=base_gpu_id,
                                     **({} if urls is None else {"urls": list(urls)}))

    def server_compression(self) -> CompressionConfig:
        """The KV compression an ``sglang`` server is started with: ``compression``, with the adaptive budget's
        ``max_budget`` when it is on (each step's requests carry their own budget)."""
        return self.budget_compression(self.adaptive_budget.max_budget if self.adaptive_budget.enabled else None)

    def for_run(self, seed: int) -> "RolloutConfig":
        """This section with what the run decides filled in: an ``sglang`` engine whose ``random_seed`` is unset
        samples from the run's ``seed`` (SGLang's per-request seeds are ignored under the sparse_kv backend, so
        without it every seed of an experiment would draw the same random numbers)."""
        if self.engine != "sglang" or self.sglang.random_seed is not None:
            return self
        return dataclasses.replace(self, sglang=dataclasses.replace(self.sglang, random_seed=seed))

    def engine_build(self, model_dir: str, *, show_progress: bool = False, slot: "EngineSlot | None" = None,
                     run_seed: int | None = None, record_routing: bool = False) -> EngineBuild:
        """What an engine of this rollout section is built from (``rollout/engine_registry.py``), the run-owned fields
        filled in here and nowhere else: the model the run exported for the engine (``model_dir``); with
        ``run_seed``, an ``sglang`` engine's unset ``random_seed`` (``for_run``); with ``slot``, the engine's place
        in the run's layout (``rollout/layout.py``: its first GPU, its server URL) and, for ``sglang``, its
        ``random_seed`` offset by the engine's index (SGLang samples from its scheduler's RNG, ignoring per-request
        seeds with the sparse_kv backend: engines with the same seed would draw the same numbers for their
        different groups). Without ``slot``: one engine on every server of ``sglang.urls``, from GPU 0.
        ``record_routing``: the engine records the sampler's routes (the run's ``learner.moe.routing_replay``)."""
        rollout = self if run_seed is None else self.for_run(run_seed)
        sglang = None
        if self.engine == "sglang":
            if slot is None:
                sglang = rollout.sglang_config(model_dir)
            else:
                sglang = rollout.sglang_config(model_dir, base_gpu_id=slot.base_gpu_id,
                                               urls=[slot.url] if slot.url else None)
                sglang = dataclasses.replace(sglang, random_seed=(sglang.random_seed or 0) + slot.index)
        return EngineBuild(model_dir=model_dir, compression=self.compression, dtype=self.dtype,
                           max_batch_size=self.max_batch_size, show_progress=show_progress, sglang=sglang,
                           options=dict(self.engine_options), record_routing=record_routing)

    @property
    def batch_size(self) -> int:
        """Samples per rollout step."""
        return self.prompts_per_step * self.samples_per_prompt
