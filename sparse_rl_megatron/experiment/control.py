"""The equal-time supervised control: the supervised stage continued from the arms' warm start, then evaluated
by the trainer's own held-out evaluation (dense and sparse, as the RL arms are at their last step).

Its length is the reference RL arm's CPU time outside evaluation divided by the warm start's CPU seconds per
supervised step (both measured on this machine, in this experiment), unless ``control.steps`` fixes it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from sparse_rl_megatron.experiment.arm_dirs import ARM_DONE, read_json, seed_dir
from sparse_rl_megatron.experiment.config import ExperimentConfig
from sparse_rl_megatron.experiment.saved_eval import evaluate_saved
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.observability.metrics_writer import METRICS_FILE, MetricsWriter
from sparse_rl_megatron.tasks import get_task
from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.trainer.runtime.model_dirs import WARM_METRICS, build_once

CONTROL_SEED_OFFSET = 1_000_003
"""The control's batches are drawn from seed + this (the warm start's own batch order is not replayed)."""
CONTROL_MODEL = "model"


def control_steps(cfg: ExperimentConfig, seed: int, warm: Path) -> tuple[int, float | None]:
    """Supervised steps of the control, and the CPU seconds they are meant to match (None when fixed)."""
    control = cfg.experiment.control
    if control.steps is not None:
        return control.steps, None
    ref = read_json(seed_dir(cfg, seed) / control.reference_arm / ARM_DONE)
    if ref is None:
        raise RuntimeError(f"the control's reference arm '{control.reference_arm}' of seed {seed} is not complete")
    warm_metrics = read_json(warm / WARM_METRICS)
    per_step = warm_metrics[MN.SFT_CPU_SECONDS] / warm_metrics[MN.SFT_STEPS]
    return max(1, round(ref["train_cpu_seconds"] / per_step)), ref["train_cpu_seconds"]


def run_control(cfg: ExperimentConfig, train_cfg: TrainConfig, seed: int, warm: Path,
                log: Callable[[str], None]) -> dict[str, float]:
    """Train the control into ``<run_dir>/model`` (once) and log its final evaluation to ``metrics.jsonl`` at the
    RL arms' last step. Returns the arm's usage and control metrics."""
    import dataclasses
    import json
    import time

    run_dir = Path(train_cfg.run_dir)
    steps, target_cpu = control_steps(cfg, seed, warm)
    task = get_task(cfg.train.model_path)
    model = run_dir / CONTROL_MODEL
    cpu0, wall0 = time.process_time(), time.perf_counter()
    log(f"seed {seed}: supervised control, {steps} steps from {warm}"
        + (f" (matching {target_cpu:.0f} CPU s of {cfg.experiment.control.reference_arm})" if target_cpu else ""))

    def train(out: Path) -> None:
        options = {**cfg.experiment.control.options, "steps": steps, "eval_problems": 0}
        sft = task.warm_start(warm, out, seed=seed + CONTROL_SEED_OFFSET, **options)
        (out / WARM_METRICS).write_text(json.dumps(sft, indent=2) + "\n")

    build_once(model, train)
    sft = json.loads((model / WARM_METRICS).read_text())
    eval_cfg = dataclasses.replace(train_cfg, model_path=str(model))
    metrics, = evaluate_saved(eval_cfg, model, cfg.train.steps, [(None, run_dir)])
    metrics.update({MN.control_key(k): v for k, v in sft.items()})
    (run_dir / METRICS_FILE).unlink(missing_ok=True)  # its one record (a re-run after a crash writes it again)
    writer = MetricsWriter(run_dir, tensorboard=False)
    writer.write(cfg.train.steps, metrics)
    writer.close()
    return {"cpu_seconds": time.process_time() - cpu0, "wall_seconds": time.perf_counter() - wall0,
            "eval_wall_seconds": metrics[MN.TIME_EVAL_S], "sft_steps": float(steps),
            "sft_cpu_seconds": sft[MN.SFT_CPU_SECONDS],
            "target_cpu_seconds": target_cpu}
