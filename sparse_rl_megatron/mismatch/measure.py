"""The measurement of ``sparse-rl mismatch``: every row through the trainer's own rollout step.

Set-up follows ``trainer/run.py`` minus what only training needs (optimizer, run-directory lock, checkpoints,
metrics files): process groups -> the model directories the run would use (``tiny`` / ``task:<name>`` built once
in ``run_dir/model`` and reused, exactly as ``sparse-rl train`` does) -> a learner without optimizer at the
recipe's TP x PP (the dense recompute of pi_old) -> engine and reward on global rank 0 -> the engine made to
serve the learner's weights (pushed when it was given an export, then the weight-sync probe).

Then, per row, ``trainer.step.rollout_step`` at rollout step 1: rank 0 samples the run's first prompts on a view
of the engine with that row's compression (same weights, same sampler seed for every row) and scores them; every
rank recomputes pi_old and runs ``prepare_correction``; rank 0 keeps the row's statistics. Under torchrun the
other ranks take part in the learner's collectives, as in training. For a mixture of experts rank 0 also splits
each compressed row's rho tail into what the attention and what the routing change cause (``routing.py``), on an
HF reference engine loaded from the same weights; and, when the engine records the sampler's routes (the HF engine
always does here), every rank recomputes pi_old replaying them and reads the learner's own routes back, so rank 0
reports the engine-vs-learner routing flips and the rho tail with routing replay (``routing.replay_split``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from sparse_rl_megatron.learner import Learner
from sparse_rl_megatron.mismatch.study import row_result
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.rollout.engine_registry import ENGINES
from sparse_rl_megatron.trainer.engine_pool.pool import EnginePool, probe_weights, sync_weights
from sparse_rl_megatron.trainer.engine_pool.weight_probe import probe_sequence, probe_tolerance
from sparse_rl_megatron.trainer.run import make_reward
from sparse_rl_megatron.trainer.runtime import distributed as D
from sparse_rl_megatron.trainer.runtime.model_dirs import export_for_engine, prepare_model
from sparse_rl_megatron.trainer.runtime.prompts import PromptOrder
from sparse_rl_megatron.trainer.step import rollout_step

if TYPE_CHECKING:
    from sparse_rl_megatron.algo import CorrectionConfig
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.mismatch.study import RowResult
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.trainer.run_plan import RunPlan

STUDY_STEP = 1
"""The rollout step whose prompts and sampler seed every row uses (the run's first step)."""


@dataclass
class Measurement:
    """What rank 0 measured (the other ranks get an empty one)."""

    rows: list["RowResult"] = field(default_factory=list)
    """Dense first, then each budget."""
    probe_max_abs_diff: float | None = None
    """Largest |log-prob difference| between engine and learner on the weight-sync probe (None: probe off)."""
    learner: str = ""
    """The learner's layout in words."""


def measure(cfg: "TrainConfig", plan: "RunPlan", rows: list[tuple[str, "CompressionConfig"]],
            correction: "CorrectionConfig", say: Callable[[str], None]) -> Measurement:
    """Sample and recompute every row of ``rows``; collective (every rank calls it). ``say`` prints on rank 0."""
    D.init(cfg.phase_timeout_s)
    with contextlib.ExitStack() as stack:
        stack.callback(D.shutdown)
        run_dir = Path(cfg.run_dir)
        dirs = D.on_main(lambda: prepare_model(cfg, plan.task, run_dir))
        for note in dirs.notes:
            say(note)
        learner = Learner(cfg.learner_config(dirs.learner), trainable=False, device_facts=plan.device_facts)
        hf_dir = dirs.engine_hf or export_for_engine(learner, run_dir)
        spec = ENGINES.get(cfg.rollout.engine)
        engine = reward = records = None
        if D.is_main():
            engine = spec.make(cfg.rollout.engine_build(hf_dir, show_progress=cfg.log.progress,
                                                        record_routing=learner.arch.is_moe))
            stack.callback(engine.shutdown)
            reward = stack.enter_context(make_reward(cfg, plan))
            records = PromptOrder(plan.train_data.records, cfg.seed, cfg.data.shuffle).take(
                cfg.rollout.prompts_per_step)
        D.wait_for_main()
        out = Measurement(learner=learner.describe())
        out.probe_max_abs_diff = _serve_learner_weights(cfg, learner, engine, push=dirs.engine_hf is None)
        oracle = None
        if learner.arch.is_moe and D.is_main():
            import torch

            from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

            oracle = HFRolloutEngine(hf_dir, dtype=getattr(torch, cfg.rollout.dtype), show_progress=False)
        for label, compression in rows:
            say(f"measuring {label}: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.samples_per_prompt} "
                f"samples, up to {cfg.rollout.sampling.max_new_tokens} tokens")
            view = engine.with_compression(compression) if engine is not None else None
            with EnginePool.single(view, reward, cfg.rollout.engine) as pool:
                batch = rollout_step(learner=learner, pool=pool, records=records, template=plan.template,
                                     n=cfg.rollout.samples_per_prompt, sampling=cfg.rollout.sampling,
                                     correction=correction, seed=cfg.seed, step=STUDY_STEP)
            replay = _replay_inputs(learner, batch) if learner.arch.is_moe else None  # collective
            if D.is_main():
                row = row_result(label, compression, batch)
                if replay is not None:
                    from sparse_rl_megatron.algo.hooks import pad
                    from sparse_rl_megatron.mismatch.routing import replay_split

                    sampler, _ = pad([s.sampler_logprobs for s in batch.samples])
                    row.stats.update(replay_split(batch.samples, replay[0], replay[1], sampler,
                                                  batch.prepared.response_mask))
                if oracle is not None and not compression.is_dense:
                    from sparse_rl_megatron.mismatch.routing import routing_split

                    prepared = batch.prepared
                    row.stats.update(routing_split(oracle, batch.samples, compression, prepared.old_log_probs,
                                                   prepared.response_mask, row.stats[MN.SPARSE_CONTAMINATED_FRAC],
                                                   correction.veto_threshold))
                out.rows.append(row)
        return out


def _replay_inputs(learner, batch):
    """``(the learner's own routes, pi_old replaying the sampler's routes)`` of a row whose samples carry routes (None
    otherwise: every rank sees the same samples, so every rank decides alike). Collective."""
    from sparse_rl_megatron.learner.batch import SequenceBatch

    if any(s.routed_experts is None for s in batch.samples):
        return None
    seqs = batch.sequences
    replayed = SequenceBatch(seqs.prompts, seqs.responses, [s.routed_experts for s in batch.samples])
    return learner.routes(seqs), learner.logprobs(replayed, width=batch.prepared.old_log_probs.shape[1])


def _serve_learner_weights(cfg: "TrainConfig", learner, engine, push: bool) -> float | None:
    """Make the engine serve the learner's weights (push them when the engine was given an export, which may
    predate the checkpoint) and probe it; returns the probe's largest difference. Collective."""
    if push:
        sync_weights(learner, engine, version=0, bucket_mb=cfg.sync.bucket_mb)
    if not cfg.sync.probe:
        return None
    probe = probe_sequence(learner.arch.vocab_size, cfg.sync.probe_tokens, cfg.seed)
    tolerance = probe_tolerance(cfg, learner)
    return probe_weights(learner, engine, probe, tolerance, cfg.rollout.engine, 0)[MN.SYNC_PROBE_MAX_ABS_DIFF]
