"""``sparse-rl smoke``: the embedded CPU default, a few real Sparse-RL steps end to end.

This is NOT the trainer (which does not exist yet: no resume, no eval loop, one process). It runs every
piece of one Sparse-RL step for real, in order, on a model small enough for a laptop CPU:

    rollout on a compressed KV cache (HF reference engine)  -> samples with pi_sparse log-probs
    math reward (math-verify in a process pool)              -> rewards
    dense recompute on the megatron-core learner             -> pi_old log-probs
    rejection + reweighting + GRPO advantages (algo)         -> prepared batch, sparse/* metrics
    corrected PPO-clip train step (Megatron optimizer)       -> new weights
    weight sync learner -> rollout engine                    -> weight version k+1
    metrics JSONL + TensorBoard + PNG, a final Megatron checkpoint

With ``model_path: tiny`` a random tiny Qwen2 is built in the run directory (no download), so rewards are
mostly 0 and nothing is learnt: the point is that every stage runs and its numbers are visible.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from sparse_rl_megatron.algo import CorrectionConfig, prepare_correction
from sparse_rl_megatron.algo.hooks import pad
from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine import SamplingParams
from sparse_rl_megatron.rollout.sample import Sample
from sparse_rl_megatron.utils.config_io import from_dict, load_config, to_dict
from sparse_rl_megatron.utils.run_dir import archive_previous_outputs


@dataclass
class SmokeConfig:
    """The embedded CPU default run (``configs/cpu_default.yaml``)."""

    run_dir: str = "runs/cpu_default"
    """Where metrics, plots, the tiny model and the final checkpoint go."""
    model_path: str = "tiny"
    """An HF model directory, or ``tiny``: a random tiny Qwen2 + tokenizer built in ``run_dir/model``."""
    dataset: str = "gsm8k_train"
    """A named data set (see ``sparse_rl_megatron.data.DATASETS``) or a JSONL/Parquet file."""
    template: str = "qwen25_chat"
    """Prompt template name (see ``sparse_rl_megatron.data.TEMPLATES``)."""
    steps: int = 3
    """Rollout steps (each: rollout, reward, recompute, correct, one optimizer step, sync)."""
    prompts_per_step: int = 4
    """GRPO groups per rollout step."""
    samples_per_prompt: int = 4
    """GRPO group size n."""
    seed: int = 0
    """Seed of prompt order, model init (tiny) and sampling."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=1.0, max_new_tokens=48))
    """Rollout sampling (temperature 1 as in the reference runs)."""
    compression: CompressionConfig = field(
        default_factory=lambda: CompressionConfig(method="rkv", budget=32, window=4, buffer=8))
    """KV compression of the rollout engine (small budget so that compression really happens here)."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Sparse-RL rejection + reweighting + advantages (reference defaults)."""
    learner: dict[str, Any] = field(default_factory=lambda: {"optim": {"lr": 1e-4}})
    """``LearnerConfig`` fields (model_path comes from above), e.g. optim.lr, tensor_parallel_size."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"SmokeConfig.{name} must be >= 1, got {getattr(self, name)}")


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    lengths = torch.tensor([float(s.response_length) for s in samples])
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/compression_events_mean": sum(s.compression.events for s in samples) / len(samples),
        "rollout/peak_kv_tokens_max": max(s.compression.peak_kv_tokens for s in samples),
    }


OUTPUTS = ("config.yaml", "metrics.jsonl", "metrics.png", "tensorboard", "checkpoint")


def _print_step(console, step: int, metrics: dict[str, float], keys: tuple[str, ...]) -> None:
    from rich.table import Table

    table = Table(title=f"step {step}", show_header=False, box=None)
    for key in keys:
        if key in metrics:
            table.add_row(key, f"{metrics[key]:.4g}")
    console.print(table)


SHOWN = ("rollout/reward_mean", "rollout/response_len_mean", "rollout/compression_events_mean",
         "rollout/peak_kv_tokens_max", "sparse/rho_p1", "sparse/rho_min", "sparse/rejected_seq_frac",
         "sparse/rejected_token_frac", "sparse/kl_k3", "loss/pg", "loss/clip_frac", "train/grad_norm",
         "time/rollout_s", "time/train_s")


def run_smoke(cfg: SmokeConfig) -> dict[str, float]:
    from rich.console import Console

    from sparse_rl_megatron.data import load_dataset, render_prompt
    from sparse_rl_megatron.learner import Learner, LearnerConfig, SequenceBatch, TrainBatch
    from sparse_rl_megatron.observability.metrics_writer import MetricsWriter
    from sparse_rl_megatron.observability.plots import plot_metrics
    from sparse_rl_megatron.rewards import MathReward
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
    from sparse_rl_megatron.utils.tiny_models import save_tiny_hf_checkpoint

    console = Console()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    archived = archive_previous_outputs(run_dir, OUTPUTS)
    if archived:
        console.print(f"previous outputs of {run_dir} moved to {archived}")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    model_path = cfg.model_path
    if model_path == "tiny":
        model_path = str(save_tiny_hf_checkpoint(run_dir / "model", seed=cfg.seed, init_std=0.2))
    learner = Learner(from_dict(LearnerConfig, {"model_path": model_path, **cfg.learner}, "learner"))
    engine = HFRolloutEngine(model_path, compression=cfg.compression, show_progress=True)
    records = list(load_dataset(cfg.dataset))
    random.Random(cfg.seed).shuffle(records)
    writer = MetricsWriter(run_dir)
    console.print(f"[bold]sparse-rl smoke[/]: {learner.describe()}; data {cfg.dataset} ({len(records)} problems); "
                  f"KV {cfg.compression.method} B={cfg.compression.budget} W={cfg.compression.buffer}")
    metrics: dict[str, float] = {}
    with MathReward() as reward:
        for step in range(cfg.steps):
            # 1. rollout on the compressed KV cache, then the math reward
            t0 = time.time()
            batch = [records[(step * cfg.prompts_per_step + i) % len(records)] for i in range(cfg.prompts_per_step)]
            prompts = [render_prompt(cfg.template, r.prompt, engine.tokenizer) for r in batch]
            sampling = dataclasses.replace(cfg.sampling, seed=cfg.seed * 100_003 + step)
            samples = engine.generate(prompts, cfg.samples_per_prompt, sampling)
            for s in samples:
                s.metadata.update(batch[s.group_id].metadata())
            reward.score_samples(samples)
            t1 = time.time()
            # 2. dense recompute of the old policy, then the Sparse-RL correction on the whole batch
            seqs = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
            old = learner.logprobs(seqs)
            sampler, _ = pad([s.sampler_logprobs for s in samples])  # [B, T], T = seqs.max_response_len
            prepared = prepare_correction(
                old, sampler, seqs.response_mask(), torch.tensor([float(s.reward) for s in samples]),
                torch.tensor([s.group_id for s in samples]), cfg.correction)
            # 3. one corrected GRPO step, then push the new weights to the rollout engine
            train = learner.train_step(TrainBatch(seqs, prepared))
            engine.update_weights((kv for bucket in learner.export_weights() for kv in bucket), version=step + 1)
            metrics = {**rollout_metrics(samples), **prepared.metrics, **train,
                       "time/rollout_s": t1 - t0, "time/train_s": time.time() - t1}
            writer.write(step, metrics)
            _print_step(console, step, metrics, SHOWN)
    writer.close()
    plot = plot_metrics(writer.path, run_dir / "metrics.png")
    ckpt = learner.save(run_dir / "checkpoint")
    console.print(f"metrics: {writer.path}  plot: {plot}  checkpoint: {ckpt}  tensorboard: {run_dir / 'tensorboard'}")
    return metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML recipe (default: the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. steps=5 compression.budget=64")


def run(args: argparse.Namespace) -> int:
    run_smoke(load_config(SmokeConfig, args.config, args.overrides))
    return 0
