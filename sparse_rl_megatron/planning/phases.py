"""The per-GPU ledger of one RL step, phase by phase, on colocated GPUs (a learner rank and an SGLang engine share
each GPU and take turns).

Phases (what is on one GPU; ``docs/memory-planning.md``, "Per-phase ledger"):

Each phase holds what its turn keeps awake (``learner/turns.py``, the table the run follows); a learner part the turn
does not need holds what the offload mode leaves of it (``residency.py``: 0 when it sleeps):

- ``rollout`` (and evaluation, the engines' turn): the engine's weights, KV pool and sparse_kv plugin tables, and
  what the sleeping learner and KL reference keep. The pool is SGLang's, sized when the engine starts, after the
  learner went to sleep: ``mem_fraction x (GPU - what the sleeping learner keeps) - engine weights - plugin``.
- ``recompute``: the learner's and the reference's weights and the temporaries of the forward-only log-probs; the
  released engine keeps nothing with SGLang's memory saver, everything without it.
- ``train``: the learner's peak (the learner table's total: weights, gradients, optimizer, activations) and what
  the released engine keeps; the reference sleeps.
- ``sync``: the learner's weights, the engine's weights resumed (its KV pool still released) and one export bucket
  (``sync.bucket_mb``, or the largest tensor when that is larger; twice with PP > 1: the owner stage's flat
  broadcast buffer).

Then the learner sleeps and the engine's KV pool is resumed. A phase fits when its total is at most the GPU; the
rollout also needs a pool that holds one sequence (SGLang refuses to start otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass

from sparse_rl_megatron.learner.turns import TURNS
from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.planning.inputs import GIB, BatchShape, Layout, LearnerSetting, RolloutSetting
from sparse_rl_megatron.planning.kv import RolloutKV, engine_weights_per_gpu
from sparse_rl_megatron.planning.learner_memory import (
    FP32,
    StageMemory,
    learner_micro_batch,
    stage_activations,
)
from sparse_rl_megatron.planning.residency import reference_resident, resident_parts, stage_parts

PHASES: tuple[str, ...] = ("rollout", "recompute", "train", "sync")
MIB = 2 ** 20

LEARNER_PART_LABELS = {"weights": "learner weights", "gradients": "learner gradients, fp32",
                       "optimizer": "learner optimizer state"}
REFERENCE = "KL reference policy weights"
ENGINE_WEIGHTS, ENGINE_POOL, ENGINE_PLUGIN = "engine weights, bf16", "engine KV pool", "sparse_kv plugin tables"
TRAIN_EXTRA = "learner activations + the larger temporary"
LOGPROB_TEMP = "log-prob recompute temporaries"
BUCKET = "weight-sync bucket"


@dataclass(frozen=True)
class Phase:
    """What one GPU holds in one phase: ``items`` label -> bytes."""

    name: str
    items: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.items.values())


@dataclass(frozen=True)
class EngineStart:
    """One GPU of a rollout engine when it starts (after the learner went to sleep)."""

    free: float
    """GPU memory minus what the sleeping learner (and reference) keep on the GPU that keeps the most: SGLang
    takes the least free memory of an engine's GPUs."""
    weights: float
    pool: float
    """The KV pool (plugin tables already out of it)."""
    plugin: float
    headroom: float
    """``(1 - mem_fraction) x free``: what SGLang leaves for its activations and CUDA graphs (not planned)."""
    sequence: float
    """KV bytes of one sequence on one GPU."""


@dataclass(frozen=True)
class Ledger:
    """The phases of one GPU of pipeline stage ``stage`` (the stage whose worst phase is the largest)."""

    stage: int
    gpu_bytes: float
    engine: EngineStart
    phases: tuple[Phase, ...]

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    @property
    def over(self) -> list[Phase]:
        """The phases whose total exceeds the GPU."""
        return [p for p in self.phases if p.total > self.gpu_bytes]

    @property
    def pool_holds_a_sequence(self) -> bool:
        return self.engine.pool >= self.engine.sequence > 0

    @property
    def fits(self) -> bool:
        return not self.over and self.pool_holds_a_sequence

    def problem(self) -> str | None:
        """One line saying which phase does not fit (None when every phase fits)."""
        gpu = self.gpu_bytes / GIB
        if not self.pool_holds_a_sequence:
            return (f"phase rollout DOES NOT FIT: the KV pool ({self.engine.pool / GIB:.2f} GiB per GPU) cannot hold "
                    f"one sequence ({self.engine.sequence / MIB:,.1f} MiB); SGLang refuses to start")
        if self.over:
            worst = max(self.over, key=lambda p: p.total)
            names = ", ".join(p.name for p in self.over)
            return (f"phase {names} DOES NOT FIT: {worst.name} needs {worst.total / GIB:.2f} GiB > {gpu:g} GiB per GPU"
                    + (f" (stage {self.stage})" if self.stage else ""))
        return None


def resident_asleep(stages: list[StageMemory], setting: LearnerSetting) -> float:
    """The most a GPU keeps of the sleeping learner and its reference (what the engine's free memory is short of)."""
    return max(sum(resident_parts(s, setting).values()) + reference_resident(s, setting) for s in stages)


def bucket_bytes(arch: ModelArch, layout: Layout, rollout: RolloutSetting) -> int:
    """One weight-sync bucket alive on a GPU: ``bucket_mb``, or the largest bf16 HF tensor when larger (a single
    tensor gets its own bucket); with PP > 1 the owner stage also concatenates it into a flat broadcast buffer."""
    h = arch.hidden_size
    largest = max(arch.vocab_size * h, arch.num_attention_heads * arch.head_dim * h,
                  (arch.ffn_hidden_size if arch.moe is None else arch.moe.num_experts) * h)
    one = max(rollout.bucket_mb * MIB, 2 * largest)
    return one * (2 if layout.pp > 1 else 1)


def logprob_temporaries(arch: ModelArch, layout: Layout, batch: BatchShape, setting: LearnerSetting,
                        stage: int) -> float:
    """Forward-only log-probs of one micro-batch on one GPU of ``stage`` (an estimate): the layer input ``e h T``,
    one layer's activations (what a layer holds while it runs; nothing is kept for backward) and its attention
    temporaries; the last stage adds the LM-head chunk (fp32 logits + the matmul output); every rank holds the
    step's ``[rollouts, response]`` fp32 log-probs."""
    mb = learner_micro_batch(batch, layout, setting)
    act = stage_activations(arch, layout.tp, layout.pp, stage, mb, setting, layout.expert_tp)
    e = setting.param_bytes
    head = 0.0
    if stage == layout.pp - 1:
        head = act.head_temporary - e * arch.padded_vocab_size(layout.tp) // layout.tp * arch.hidden_size
    return (e * arch.hidden_size * mb.tokens + act.layer + act.attention_temporary + head
            + FP32 * batch.rollouts * batch.response_len)


PHASE_TURNS: dict[str, str] = {"rollout": "engines", "recompute": "recompute", "train": "train", "sync": "sync"}
"""The turn (``learner/turns.py``) each phase of the ledger runs in."""


def stage_ledger(arch: ModelArch, layout: Layout, batch: BatchShape, learner: LearnerSetting,
                 rollout: RolloutSetting, stage: StageMemory, kv: RolloutKV, engine: EngineStart) -> tuple[Phase, ...]:
    """The four phases of one GPU of ``stage``; ``kv`` is the run's rollout setting, ``engine`` its start. Each
    phase holds what its turn keeps awake (``learner.turns.TURNS``): a learner part the turn does not need holds
    what the offload mode leaves of it (0 when it sleeps), an engine part it does not need is released (nothing
    with SGLang's memory saver, everything without it)."""
    awake_parts = stage_parts(stage, learner)
    asleep_parts = resident_parts(stage, learner)
    ref_awake = float(stage.reference) if learner.reference_model else None
    ref_asleep = float(reference_resident(stage, learner)) if learner.reference_model else None
    engine_parts = {"weights": {ENGINE_WEIGHTS: engine.weights},
                    "kv_cache": {ENGINE_POOL: max(engine.pool, 0.0), ENGINE_PLUGIN: engine.plugin}}

    def held(turn: str) -> dict[str, float]:
        needs = TURNS[turn]
        items = {LEARNER_PART_LABELS[p]: float(awake_parts[p] if p in needs.policy else asleep_parts[p])
                 for p in awake_parts}
        if ref_awake is not None:
            items[REFERENCE] = ref_awake if "weights" in needs.reference else ref_asleep
        for part, entries in engine_parts.items():
            if part in needs.engines or not rollout.memory_saver:
                items.update(entries)
        return items

    static = sum(awake_parts.values())
    extra = {"recompute": {LOGPROB_TEMP: logprob_temporaries(arch, layout, batch, learner, stage.stage)},
             "train": {TRAIN_EXTRA: stage.total(learner) - static - stage.reference_training(learner)},
             "sync": {BUCKET: float(bucket_bytes(arch, layout, rollout))}}
    return tuple(Phase(name, {**held(PHASE_TURNS[name]), **extra.get(name, {})}) for name in PHASES)


def phase_ledger(arch: ModelArch, layout: Layout, batch: BatchShape, learner: LearnerSetting, rollout: RolloutSetting,
                 stages: list[StageMemory], kv: RolloutKV) -> Ledger:
    """The ledger of the stage whose largest phase is the largest; ``kv`` the run's rollout setting, sized with the
    sleeping learner's ``resident_asleep`` (``plan.py``)."""
    gpu = layout.gpu_memory_gib * GIB
    free = gpu - resident_asleep(stages, learner)
    plugin = float(kv.plugin.total) if kv.plugin is not None else 0.0
    engine = EngineStart(free=free, weights=engine_weights_per_gpu(arch, rollout), pool=kv.pool_per_gpu, plugin=plugin,
                         headroom=(1 - rollout.mem_fraction) * free, sequence=kv.bytes_per_sequence_per_gpu)
    ledgers = [Ledger(s.stage, gpu, engine, stage_ledger(arch, layout, batch, learner, rollout, s, kv, engine))
               for s in stages]
    return max(ledgers, key=lambda led: (max(p.total for p in led.phases), -led.stage))
