"""Typed configuration of ``sparse-rl train``: one section per component, every field documented.

``TrainConfig`` is built from a YAML recipe (with ``include:``) plus ``key.path=value`` overrides by
``utils.config_io``; an unknown key, a wrong type or a bad value is a ``ConfigError`` naming the dotted field
and, where there is a choice, the valid values. Checks that need no file and no model run here (in the
dataclasses' ``__post_init__``); checks against files, the world size and the registries run in
``trainer/run_plan.py``, still before any model loads.

The ``learner`` section is a ``LearnerSettings`` (every ``LearnerConfig`` field except ``model_path``, the run's);
the ``rollout`` section a ``RolloutConfig``, beside the engines it builds (``rollout/config.py``), whose ``sglang``
section is an ``SGLangOptions`` (``SGLangEngineConfig`` less what the run fills in);
Megatron's own knobs pass through its ``megatron_overrides`` / ``optimizer_overrides``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

from sparse_rl_megatron.algo.config import CorrectionConfig
from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.learner.config import LearnerConfig, LearnerSettings
from sparse_rl_megatron.models.families import families
from sparse_rl_megatron.rewards.pool import VerifierPoolConfig
from sparse_rl_megatron.rollout.config import RolloutConfig

RESUME_MODES = ("auto", "never")
EvalMode = Literal["dense", "sparse", "adaptive"]
EVAL_MODES: tuple[str, ...] = get_args(EvalMode)
"""``dense``: full KV cache; ``sparse``: the stated compression (``eval.compression``, else the rollout's as
configured: with the adaptive budget, its start budget, never the controller's, so evaluations at different steps
compare); ``adaptive``: the rollout's compression at the adaptive budget controller's current budget (only with
``rollout.adaptive_budget.enabled``)."""
DEFAULT_EVAL_MODES = ("dense", "sparse")
SINGLE_SAMPLE_ESTIMATORS = ("reinforce",)
"""Advantage estimators that give a signal with one sample per prompt (a batch baseline); the group-based ones
(grpo, drgrpo, rloo) give every sample of a one-sample group advantage 0, i.e. nothing to learn."""
TINY_MODEL = "tiny"
"""``model_path`` value: a random tiny Qwen2 + byte-level tokenizer built in the run directory (no download)."""
TINY_MODELS = {s.tiny_model_path: s.name for s in families() if s.tiny_model_path is not None}
"""``model_path`` values of the random tiny models built in the run directory -> their ``models.tiny`` family (each
family's ``FamilySpec.tiny_model_path``): ``tiny`` (Qwen2), ``tiny-qwen3-moe`` and ``tiny-qwen2-moe`` (4 experts,
top-2; the latter with a shared expert)."""


@dataclass
class DataConfig:
    """Where training prompts come from."""

    dataset: str = "gsm8k_train"
    """A named data set (``data.DATASETS``), a JSONL/Parquet file, or ``task:<name>`` (its train split)."""
    data_root: str | None = None
    """Folder holding the shared data of named sets (default ``../shared/data`` or ``$SPARSE_RL_DATA``)."""
    template: str | None = None
    """Prompt template (``data.TEMPLATES``); None: the task's template, else ``qwen25_chat``."""
    input_key: str = "prompt"
    """Prompt field of a dataset given as a user file."""
    label_key: str = "answer"
    """Gold-answer field of a dataset given as a user file."""
    limit: int | None = None
    """Use only the first N problems (None: all)."""
    shuffle: bool = True
    """Visit the problems in a new seeded order each epoch (else in file order)."""

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"DataConfig.limit must be >= 1 or None (all problems), got {self.limit}")


@dataclass
class RewardConfig:
    """How responses are scored."""

    name: str | None = None
    """Reward (``rewards.REWARDS``); None: the task's reward, else ``math``."""
    verifier: VerifierPoolConfig = field(default_factory=VerifierPoolConfig)
    """Worker processes and time limit of the ``math`` reward."""


@dataclass
class SyncConfig:
    """Weight sync learner -> rollout engine, and the check that the engine serves the new weights."""

    bucket_mb: int = 512
    """Size of one HF-named weight bucket (MiB)."""
    probe: bool = True
    """After every sync, compare the engine's dense log-probs of a fixed probe sequence with the learner's."""
    probe_tokens: int = 32
    """Length of the probe sequence (half prompt, half response), drawn once from the run's seed."""
    probe_tolerance: float | None = None
    """Largest allowed MEAN |log-prob difference| over the probe's response tokens (None: 1e-3 when the engine and
    the learner compute in float32, 0.3 when either is 16-bit; derived in ``trainer/engine_pool/weight_probe.py``)."""

    def __post_init__(self) -> None:
        if self.bucket_mb < 1:
            raise ValueError(f"SyncConfig.bucket_mb must be >= 1, got {self.bucket_mb}")
        if self.probe_tokens < 2:
            raise ValueError(f"SyncConfig.probe_tokens must be >= 2 (a prompt and a response token), got "
                             f"{self.probe_tokens}")
        if self.probe_tolerance is not None and not self.probe_tolerance > 0:
            raise ValueError(f"SyncConfig.probe_tolerance must be > 0 or None, got {self.probe_tolerance}")


@dataclass
class CheckpointConfig:
    """Checkpoints (learner, optimizer, schedule, data position, RNG of every rank) and resume."""

    save_every: int = 0
    """Save every k rollout steps (0: only at the end and when stopped by a signal)."""
    keep_last: int = 2
    """Complete checkpoints kept (older ones are deleted)."""
    resume: str = "auto"
    """``auto``: continue from the newest complete checkpoint of the run directory, if any; ``never``: start
    over (earlier outputs are archived); or the path of a ``checkpoints/step_<k>`` directory."""

    def __post_init__(self) -> None:
        if self.save_every < 0:
            raise ValueError(f"CheckpointConfig.save_every must be >= 0 (0 = only at the end), got {self.save_every}")
        if self.keep_last < 1:
            raise ValueError(f"CheckpointConfig.keep_last must be >= 1, got {self.keep_last}")
        if not self.resume:
            raise ValueError(f"CheckpointConfig.resume must be {', '.join(RESUME_MODES)} or a checkpoint path")


@dataclass
class TrainEvalConfig:
    """Periodic evaluation of the live policy on held-out problems, under dense and sparse inference."""

    every: int = 0
    """Evaluate every k rollout steps (0: only before the first and after the last step)."""
    at_start: bool = True
    """Evaluate before the first step (the 'before' of the before/after accuracy)."""
    datasets: list[str] = field(default_factory=list)
    """Named sets or files; empty: the task's held-out split when training on a task, else no evaluation."""
    limit: int | None = 64
    """First N problems of each data set (None: all)."""
    n: int = 1
    """Samples per problem (accuracy is avg@n)."""
    max_new_tokens: int | None = None
    """Response length (None: the rollout's ``sampling.max_new_tokens``)."""
    temperature: float = 0.0
    """Sampling temperature (0 = greedy, the least noisy estimate on a small held-out set)."""
    top_p: float = 1.0
    """Nucleus mass."""
    modes: list[EvalMode] = field(default_factory=lambda: list(DEFAULT_EVAL_MODES))
    """``dense`` (full KV cache), ``sparse`` (``compression``; skipped when that is dense) and/or ``adaptive`` (the
    rollout's compression at the adaptive budget controller's current budget; needs
    ``rollout.adaptive_budget.enabled``)."""
    compression: CompressionConfig | None = None
    """KV compression of the ``sparse`` mode (None: the rollout's, as configured: with the adaptive budget its start
    budget ``rollout.compression.budget``, never the controller's); a fixed one compares runs whose rollouts differ."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"TrainEvalConfig.every must be >= 0 (0 = start and end only), got {self.every}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"TrainEvalConfig.limit must be >= 1 or None (all problems), got {self.limit}")
        if self.n < 1:
            raise ValueError(f"TrainEvalConfig.n must be >= 1, got {self.n}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"TrainEvalConfig.max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"TrainEvalConfig needs temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, "
                             f"{self.top_p}")
        bad = [m for m in self.modes if m not in EVAL_MODES]
        if bad or not self.modes:
            raise ValueError(f"TrainEvalConfig.modes must be a non-empty list of {', '.join(EVAL_MODES)}, got "
                             f"{self.modes}")


@dataclass
class LogConfig:
    """What the run shows and writes while it trains."""

    progress: bool = True
    """Progress bars (rollout, optimizer steps) and a table of key metrics per step."""
    tensorboard: bool = True
    """Write TensorBoard logs next to ``metrics.jsonl``."""
    heartbeat: bool = False
    """Print a time-stamped line as each phase of each step starts (cluster logs: a hang says where)."""
    plot: bool = True
    """Draw ``metrics.png`` at the end of the run."""


WARM_RETRY_SEED_STRIDE = 1000
"""Attempt k of a task's warm start trains with seed ``seed + k * WARM_RETRY_SEED_STRIDE`` (its batches, key-dropout
masks and torch seed; the model it starts from stays the one built with ``seed``)."""


@dataclass
class WarmCheckConfig:
    """The check of a task's warm start against what its teacher taught (``tasks/warm_check.py``), and the rule on a
    miss: warm-start again with the next seed, up to ``attempts`` in all, then stop in one line."""

    enabled: bool = True
    """Check the warm start of a task that states its expectations (``task:<name>`` models; others are unchecked)."""
    attempts: int = 3
    """Warm starts tried before the run stops (seeds ``seed``, ``seed`` + 1000, ...)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"WarmCheckConfig.attempts must be >= 1, got {self.attempts}")

    def seed(self, run_seed: int, attempt: int) -> int:
        """The warm-start seed of ``attempt`` (0-based)."""
        return run_seed + attempt * WARM_RETRY_SEED_STRIDE


@dataclass
class ExpectConfig:
    """The documented result of a recipe: the run's last line says whether it landed inside (``sparse-rl train``)."""

    step: int | None = None
    """The evaluation step the ranges are for (None: no documented result)."""
    ranges: dict[str, list[float]] = field(default_factory=dict)
    """``{metric: [low, high]}`` (metrics of ``metrics.jsonl``, e.g. ``eval/dense/shortcut_free_accuracy``)."""
    source: str = ""
    """Where the ranges come from (a doc and the draws measured), printed with the verdict."""
    overridden: list[str] = field(default_factory=list)
    """Recipe keys the command line changed (besides ``seed``, ``run_dir``, ``log``, ``checkpoint``): set by
    ``sparse-rl train``; the verdict then says the range is the recipe's as written."""

    def __post_init__(self) -> None:
        for key, bounds in self.ranges.items():
            if len(bounds) != 2 or not bounds[0] <= bounds[1]:
                raise ValueError(f"ExpectConfig.ranges['{key}'] must be [low, high] with low <= high, got {bounds}")
        if self.ranges and self.step is None:
            raise ValueError("ExpectConfig.step must name the evaluation step its ranges are for")


@dataclass
class LaunchConfig:
    """What the recipe was written for (``sparse-rl preflight`` checks a launch against it)."""

    gpus: int | None = None
    """GPUs (ranks) the recipe expects in total; None: any count that TP x PP divides."""
    layout: str = ""
    """The intended layout in words (nodes, GPUs, TP x PP x DP, where the engines run); printed at start."""

    def __post_init__(self) -> None:
        if self.gpus is not None and self.gpus < 1:
            raise ValueError(f"LaunchConfig.gpus must be >= 1 or None, got {self.gpus}")


@dataclass
class TrainConfig:
    """One ``sparse-rl train`` run."""

    DERIVED_KEYS: ClassVar[dict[str, str]] = {"launch.layout": "launch.gpus", "rollout.sglang": "rollout.engine"}
    """Recipe keys written for one value of another, dropped when an override changes that other one (unless they
    are overridden too): a recipe run at another size (``launch.gpus=1``) loses its ``launch.layout`` (the
    start-up line says what runs); one run with another engine (``rollout.engine=hf``) its ``rollout.sglang``."""

    run_dir: str = "runs/train"
    """Where config, metrics, plots, checkpoints, eval results and built models go (one run at a time)."""
    model_path: str = TINY_MODEL
    """An HF model directory, a sparse-rl Megatron checkpoint, ``tiny`` (random tiny Qwen2 built in the run
    directory) or ``task:<name>`` (the task's model, built and warm-started once in the run directory)."""
    seed: int = 0
    """Seed of the prompt order, the sampler, a built model and the weight-sync probe."""
    plugins: list[str] = field(default_factory=list)
    """Python modules imported first (on every rank); they may register tasks, rewards, templates, engines."""
    steps: int = 3
    """Rollout steps (each: rollout, reward, recompute, correction, optimizer steps, sync)."""
    global_batch_size: int | None = None
    """Samples per optimizer step: a rollout batch (prompts_per_step x samples_per_prompt) is split into
    that many-sample slices, one optimizer step each (None: one step on the whole rollout batch)."""
    warm_start: dict[str, Any] = field(default_factory=dict)
    """Options of the task's supervised warm start (``task:<name>`` models only)."""
    warm_check: WarmCheckConfig = field(default_factory=WarmCheckConfig)
    """The check of the warm start and the retry rule on a miss."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engine, group size, sampling, KV compression."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring of responses."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Sparse-RL rejection + reweighting + advantages (reference defaults)."""
    learner: LearnerSettings = field(default_factory=LearnerSettings)
    """The Megatron learner (parallel layout, optimizer, loss with its KL coefficient, Megatron knobs)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight sync to the engine and its probe."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    eval: TrainEvalConfig = field(default_factory=TrainEvalConfig)
    """Periodic held-out evaluation (dense and sparse)."""
    log: LogConfig = field(default_factory=LogConfig)
    """Progress, TensorBoard, heartbeat, plot."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """The GPUs and layout the recipe expects."""
    expect: ExpectConfig | None = None
    """The recipe's documented result, compared at the end of the run (None: none; a recipe that includes one with a
    documented result sets ``expect: null``, the result not being its own)."""
    phase_timeout_s: int = 4 * 3600
    """Longest a phase that waits on the rollout engines (rollout + reward, weight sync, probe, evaluation, a
    rank building a model) may take before the ranks call it a hang: an engine that has not answered by then
    (less a margin to report it) fails the step on every rank, naming the engine and its rank."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"TrainConfig.steps must be >= 1, got {self.steps}")
        if self.phase_timeout_s < 1:
            raise ValueError(f"TrainConfig.phase_timeout_s must be >= 1, got {self.phase_timeout_s}")
        rollout_batch = self.rollout.batch_size
        if self.global_batch_size is not None and (
                self.global_batch_size < 1 or rollout_batch % self.global_batch_size):
            raise ValueError(
                f"TrainConfig.global_batch_size={self.global_batch_size} must divide the rollout batch "
                f"rollout.prompts_per_step x rollout.samples_per_prompt = {rollout_batch}")
        self.learner.optim.for_run(self.total_optimizer_steps)  # a decay shorter than the run: one line
        self._check_eval_modes()
        if self.learner.moe.routing_replay and self.rollout.partial.enabled:
            raise ValueError("learner.moe.routing_replay=true with rollout.partial.enabled: a continued response's "
                             "routes are not recorded across its re-prefill; valid: one of the two")
        if self.learner.moe.routing_replay and self.rollout.engine != "hf":
            raise ValueError(
                f"learner.moe.routing_replay=true with rollout.engine='{self.rollout.engine}': only the hf engine "
                "records the sampler's experts (at decode time, compressed requests included); SGLang's "
                "return_routed_experts reads a request's experts back through its req_to_token row, which the "
                "sparse_kv plugin rewrites for compressed requests, and the sglang engine does not ask for them; "
                "valid: rollout.engine=hf, or routing_replay=false")
        if (self.rollout.samples_per_prompt == 1
                and self.correction.advantage_estimator not in SINGLE_SAMPLE_ESTIMATORS):
            raise ValueError(
                f"rollout.samples_per_prompt=1 with correction.advantage_estimator="
                f"'{self.correction.advantage_estimator}' trains on zero advantages (a group of one has no "
                f"baseline); use samples_per_prompt >= 2 or an estimator that works with one sample: "
                f"{', '.join(SINGLE_SAMPLE_ESTIMATORS)}")

    def _check_eval_modes(self) -> None:
        """``adaptive`` evaluation needs the controller; an ``sglang`` engine serves a ``sparse`` evaluation's
        compression per request, within the server's window and B + W (``RolloutConfig.server_compression``)."""
        if "adaptive" in self.eval.modes and not self.rollout.adaptive_budget.enabled:
            raise ValueError("eval.modes has 'adaptive' (the adaptive budget controller's current budget), but "
                             "rollout.adaptive_budget.enabled is false")
        server, stated = self.rollout.server_compression(), self.eval.compression
        if self.rollout.engine != "sglang" or "sparse" not in self.eval.modes or stated is None or stated.is_dense \
                or server.is_dense:
            return
        if stated.window > server.window or stated.max_candidates > server.max_candidates:
            raise ValueError(f"eval.compression ({stated.describe()}) does not fit the sglang servers' "
                             f"({server.describe()}): its window and budget + buffer must be at most the servers' "
                             f"(they size the query ring and the position buffer)")

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return 1 if self.global_batch_size is None else self.rollout.batch_size // self.global_batch_size

    @property
    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (rollout steps x optimizer steps per rollout, none skipped)."""
        return self.steps * self.optimizer_steps_per_rollout

    def learner_config(self, model_path: str) -> LearnerConfig:
        """The ``LearnerConfig`` of this run for the model at ``model_path`` (its lr schedule sized to the run:
        ``OptimConfig.for_run``)."""
        cfg = LearnerConfig.of(self.learner, model_path)
        cfg.optim = cfg.optim.for_run(self.total_optimizer_steps)
        return cfg
