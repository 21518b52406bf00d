"""Typed configuration of the Megatron learner: parallel layout, batching, optimizer, loss.

Megatron's own knobs pass through unchanged as dicts (``megatron_overrides`` -> ``TransformerConfig``,
``optimizer_overrides`` -> ``OptimizerConfig``) instead of being mirrored field by field here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

import torch

from sparse_rl_megatron.algo.loss import LossConfig
from sparse_rl_megatron.learner.batch import BATCH_LAYOUTS
from sparse_rl_megatron.learner.logprobs import DEFAULT_CHUNK_TOKENS
from sparse_rl_megatron.learner.model_provider import EXPERT_KERNELS, LAYER_SPECS
from sparse_rl_megatron.learner.offload import OFFLOAD_MODES
from sparse_rl_megatron.models.arch import DEFAULT_VOCAB_MULTIPLE
from sparse_rl_megatron.utils.device import DeviceFacts, resolve

LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]
LR_DECAY_STYLES: tuple[str, ...] = get_args(LrDecayStyle)
DECAYING_STYLES = ("linear", "cosine")
"""Schedules that reach ``min_lr`` at ``lr_decay_steps`` (and stay there)."""
ParamsDtype = Literal["auto", "float32", "bfloat16"]
PARAM_DTYPES: tuple[str, ...] = get_args(ParamsDtype)
LayerSpecName = Literal["auto", "local", "te"]
"""The names of ``learner.model_provider.LAYER_SPECS`` (the registry checks them and says what each is)."""
ExpertKernelsName = Literal["auto", "grouped", "sequential"]
"""The names of ``learner.model_provider.EXPERT_KERNELS``."""
RouterDtype = Literal["params", "fp32"]
ROUTER_DTYPES: tuple[str, ...] = get_args(RouterDtype)
BatchLayoutName = Literal["padded", "packed"]
"""The names of ``learner.batch.BATCH_LAYOUTS`` (the registry checks them and says what each costs)."""


@dataclass
class OptimConfig:
    """Adam + schedule (defaults: the Sparse-RL reference runs, lr 1e-6 constant, wd 0.1, betas 0.9/0.98)."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decaying schedules."""
    lr_warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps."""
    lr_decay_style: LrDecayStyle = "constant"
    """Schedule after warm-up: constant, linear, cosine, inverse-square-root."""
    lr_decay_steps: int | None = 1_000_000
    """Optimizer steps (warm-up included) after which linear/cosine decay reach ``min_lr``; None: the run's
    optimizer steps (``sparse-rl train`` fills it in: steps x optimizer steps per rollout), so a ``steps=``
    override stretches the schedule instead of leaving the lr at ``min_lr``."""
    allow_short_decay: bool = False
    """Let a decaying schedule reach ``min_lr`` before the run's last optimizer step (``sparse-rl train``
    refuses an ``lr_decay_steps`` shorter than the run otherwise)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to biases and norm weights, as in Megatron)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.98
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global grad-norm clip (0 = off)."""
    use_distributed_optimizer: bool | None = None
    """Shard optimizer state over data-parallel ranks (None: on with CUDA, off on CPU)."""

    def __post_init__(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"OptimConfig.lr_decay_style must be one of {', '.join(LR_DECAY_STYLES)}, "
                             f"got {self.lr_decay_style!r}")
        for name in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"OptimConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise ValueError(f"OptimConfig.min_lr={self.min_lr} must be <= lr={self.lr}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError(f"OptimConfig.adam_beta1/adam_beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")
        if self.lr_warmup_steps < 0 or (self.lr_decay_steps is not None
                                        and self.lr_decay_steps <= self.lr_warmup_steps):
            raise ValueError(f"OptimConfig needs 0 <= lr_warmup_steps < lr_decay_steps, got "
                             f"{self.lr_warmup_steps}, {self.lr_decay_steps}")

    def for_run(self, optimizer_steps: int) -> "OptimConfig":
        """This schedule for a run of ``optimizer_steps``: ``lr_decay_steps`` None becomes that length (at least
        one step past the warm-up). Raises ``ValueError`` naming the field when a decaying schedule would reach
        ``min_lr`` before the run ends, unless ``allow_short_decay``."""
        import dataclasses

        if self.lr_decay_steps is None:
            return dataclasses.replace(self, lr_decay_steps=max(optimizer_steps, self.lr_warmup_steps + 1))
        if (self.lr_decay_style in DECAYING_STYLES and self.lr_decay_steps < optimizer_steps
                and not self.allow_short_decay):
            raise ValueError(
                f"learner.optim.lr_decay_steps={self.lr_decay_steps} ends the {self.lr_decay_style} decay before the "
                f"run's {optimizer_steps} optimizer steps (the lr would sit at min_lr={self.min_lr} from step "
                f"{self.lr_decay_steps + 1}); set lr_decay_steps: null (the run's length), >= {optimizer_steps}, "
                f"or allow_short_decay: true")
        return self


@dataclass
class MoESettings:
    """How a mixture-of-experts model trains (ignored by dense models). Routing follows the checkpoint (top-k of a
    softmax router, renormalised when its ``norm_topk_prob`` says so); tokens travel to the experts with
    megatron-core's ``alltoall`` dispatcher (gloo on CPU, NCCL on GPU; ``megatron_overrides`` can choose another)."""

    aux_loss_coeff: float | None = None
    """Weight of megatron-core's load-balancing loss PER LAYER (Switch-style ``E sum_e f_e P_e``, 1 when balanced,
    summed over the L layers, averaged over the step's tokens, padding excluded); a value given here is read in that
    per-layer convention. None: derived from the checkpoint's ``router_aux_loss_coef`` (HF's convention: one loss
    over all layers' routings jointly, k when balanced) as ``router_aux_loss_coef x top_k / L`` (0.001 x 8 / 48 for
    Qwen3-30B-A3B), which gives every router HF's gradient when the layers route alike and the value HF's plus the
    layers' covariance term (``moe_aux_loss.per_layer_coeff``); 0 when it has none. 0 turns it off; it is logged
    as ``train/moe_load_balancing_loss`` whenever it is on."""
    router_dtype: RouterDtype = "params"
    """The router's logits: in the parameter dtype (``params``, as the HF model and the rollout engines) or in
    ``fp32`` (megatron-core's advice for bf16 training; routing then differs from a bf16 engine's more often)."""
    experts: ExpertKernelsName = "auto"
    """The routed experts' kernels: auto (Transformer Engine's grouped GEMM where the TE layer spec runs, i.e. a GPU
    with TE; megatron-core's sequential experts otherwise), grouped (TE only), sequential (one GEMM per expert)."""
    routing_replay: bool = False
    """R3 routing replay (``learner/routing_replay.py``): the dense recompute and the training forward route every
    fed token to the experts the sampler chose (recorded at decode time, compressed cache included; the ``hf``
    engine records them), with the learner's own router weights at them; off: the learner's routers choose."""

    def __post_init__(self) -> None:
        if self.aux_loss_coeff is not None and self.aux_loss_coeff < 0:
            raise ValueError(f"LearnerConfig.moe.aux_loss_coeff must be >= 0 or null, got {self.aux_loss_coeff}")
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"LearnerConfig.moe.router_dtype must be one of {', '.join(ROUTER_DTYPES)}, "
                             f"got {self.router_dtype!r}")
        EXPERT_KERNELS.check(self.experts, "learner.moe.experts")


@dataclass
class LearnerSettings:
    """The Megatron learner but its model: how it is split, how batches are cut, how it trains (the ``learner``
    section of ``sparse-rl train``, whose model is the run's ``model_path``).

    Fusions (``models.megatron_config.fusion_settings``), on CUDA: fused SwiGLU (``bias_activation_fusion``)
    and bias-dropout-add on; fused RoPE on with Transformer Engine; gradient-accumulation fusion and the masked
    softmax kernels on when apex's kernels import; ``persist_layer_norm`` off (LayerNorm only); DDP's
    ``overlap_grad_reduce`` on. On CPU all of them are off. ``megatron_overrides`` can still set any of them;
    ``Learner.describe()`` lists the ones in effect.
    """

    tensor_parallel_size: int = 1
    """TP degree; must divide the attention heads, the KV groups and the FFN width."""
    pipeline_parallel_size: int = 1
    """PP degree; must divide the number of layers. The world size / (TP x PP) is the DP degree."""
    expert_parallel_size: int = 1
    """EP degree (mixtures of experts): the routed experts are split over this many ranks of each pipeline
    stage; must divide the experts, and EP x expert TP must divide world size / PP. 1 for a dense model."""
    expert_tensor_parallel_size: int | None = None
    """Expert TP degree: each routed expert's matrices split over this many ranks; None: the TP degree (as
    megatron-core). Must divide an expert's width (``moe_intermediate_size``)."""
    params_dtype: ParamsDtype = "auto"
    """Parameter dtype: float32, bfloat16, or auto (bfloat16 with CUDA, float32 on CPU)."""
    layer_spec: LayerSpecName = "auto"
    """Transformer layer implementation: te (Transformer Engine), local (megatron-core), auto."""
    batch_layout: BatchLayoutName = "padded"
    """Micro-batch layout: padded (rows right-padded) or packed (rows concatenated, block-causal mask)."""
    max_tokens_per_device: int = 16384
    """Token budget of one micro-batch on one device (dynamic micro-batching)."""
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Scored tokens per LM-head chunk (0 = no chunking)."""
    vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE
    """Pad the vocabulary to a multiple of this (x TP when TP does not divide it)."""
    seed: int = 1234
    """Seed of megatron-core's RNG trackers."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The corrected GRPO loss (from ``sparse_rl_megatron.algo``)."""
    moe: MoESettings = field(default_factory=MoESettings)
    """Load-balancing loss and router precision of a mixture-of-experts model."""
    offload: str = "none"
    """What of the learner sleeps while the colocated engines decode and evaluate (``learner/offload.py``): none,
    optimizer (Adam's moments and fp32 main weights), all (weights, gradients and optimizer state)."""
    megatron_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra ``TransformerConfig`` fields, e.g. ``{"recompute_granularity": "full", "sequence_parallel": True}``
    (sequence parallel: TP >= 2 and Transformer Engine norms; context parallel is refused)."""
    optimizer_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra ``OptimizerConfig`` fields."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"LearnerConfig.tensor_parallel_size/pipeline_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}, {self.pipeline_parallel_size}")
        if self.expert_parallel_size < 1 or (self.expert_tensor_parallel_size is not None
                                             and self.expert_tensor_parallel_size < 1):
            raise ValueError(f"LearnerConfig.expert_parallel_size/expert_tensor_parallel_size must be >= 1 (or null "
                             f"for the latter), got {self.expert_parallel_size}, {self.expert_tensor_parallel_size}")
        if self.params_dtype not in PARAM_DTYPES:
            raise ValueError(f"LearnerConfig.params_dtype must be one of {', '.join(PARAM_DTYPES)}, got {self.params_dtype!r}")
        LAYER_SPECS.check(self.layer_spec, "LearnerConfig.layer_spec")
        BATCH_LAYOUTS.check(self.batch_layout, "LearnerConfig.batch_layout")
        OFFLOAD_MODES.check(self.offload, "learner.offload")
        if self.max_tokens_per_device < 1:
            raise ValueError(f"LearnerConfig.max_tokens_per_device must be >= 1, got {self.max_tokens_per_device}")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"LearnerConfig.logprob_chunk_tokens must be >= 0 (0 = unchunked), got {self.logprob_chunk_tokens}")
        overrides = self.megatron_overrides
        if overrides.get("context_parallel_size", 1) != 1:
            raise ValueError("LearnerConfig.megatron_overrides.context_parallel_size: context parallel is not "
                             "supported by the learner (its parallel state, batch split and log-prob gather do not "
                             f"split the sequence over CP ranks); valid: 1, got {overrides['context_parallel_size']}")
        if overrides.get("sequence_parallel", False) and self.tensor_parallel_size < 2:
            raise ValueError("LearnerConfig.megatron_overrides.sequence_parallel=True splits the sequence over the "
                             f"tensor-parallel ranks and needs tensor_parallel_size >= 2, got {self.tensor_parallel_size}")
        if (self.moe.routing_replay and self.pipeline_parallel_size > 1
                and overrides.get("recompute_granularity") is not None):
            raise ValueError("LearnerConfig.moe.routing_replay=true with megatron_overrides.recompute_granularity at "
                             f"pipeline_parallel_size={self.pipeline_parallel_size}: the 1F1B schedule recomputes a "
                             "micro-batch's forward after later ones armed the routers; valid: "
                             "pipeline_parallel_size=1, no recompute_granularity, or routing_replay=false")
        if self.moe.routing_replay and overrides.get("moe_router_fusion", False):
            raise ValueError("LearnerConfig.moe.routing_replay=true with megatron_overrides.moe_router_fusion=true: "
                             "the fused router bypasses megatron-core's RouterReplay; valid: moe_router_fusion=false")
        if self.loss.entropy_coef > 0:
            raise ValueError("LearnerConfig.loss.entropy_coef > 0 is not supported by the Megatron learner "
                             "(vocab-parallel entropy is not implemented); valid: 0")

    @property
    def expert_tensor_parallel(self) -> int:
        """The expert TP degree in effect: ``expert_tensor_parallel_size``, or the TP degree when that is None."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_parallel_size if etp is None else etp

    def torch_params_dtype(self, device: DeviceFacts | None = None) -> torch.dtype:
        """The parameter dtype on ``device`` (default: this machine): ``auto`` is ``device.auto_params_dtype``."""
        name = resolve(device).auto_params_dtype if self.params_dtype == "auto" else self.params_dtype
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]

    def distributed_optimizer(self, device: DeviceFacts | None = None) -> bool:
        """``optim.use_distributed_optimizer``; None: on with CUDA on ``device`` (default: this machine)."""
        flag = self.optim.use_distributed_optimizer
        return resolve(device).cuda if flag is None else flag


@dataclass(kw_only=True)
class LearnerConfig(LearnerSettings):
    """The Megatron learner: which model (``model_path``), and the ``LearnerSettings``."""

    model_path: str
    """An HF checkpoint directory (config.json + safetensors) or a sparse-rl Megatron checkpoint."""

    @classmethod
    def of(cls, settings: LearnerSettings, model_path: str) -> "LearnerConfig":
        """``settings`` learning the model at ``model_path``."""
        return cls(model_path=model_path, **{f.name: getattr(settings, f.name) for f in fields(LearnerSettings)})
