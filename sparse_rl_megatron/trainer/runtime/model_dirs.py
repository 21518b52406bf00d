"""Which model directories a run trains from and samples with (rank 0 builds what has to be built).

- an HF directory: the learner loads it and the engine serves it;
- a sparse-rl Megatron checkpoint: the learner loads it; the engine gets an HF export of it (``model/hf``);
- ``tiny``: a random tiny Qwen2 + byte-level tokenizer, built once in ``model/init``;
- ``task:<name>``: the task's model built once in ``model/init``, warm-started once into ``model/warm``.
Built directories appear atomically (written as ``<dir>.partial``, then renamed), so a re-run or a resumed run
reuses a complete one and rebuilds an interrupted one.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MODEL_DIR = "model"
WARM_METRICS = "warm_start.json"


@dataclass
class ModelDirs:
    """Where the learner loads from and which HF directory the engine serves (None: export the learner's)."""

    learner: str
    engine_hf: str | None
    notes: list[str] = field(default_factory=list)
    """What was built or reused (printed by rank 0)."""


def build_once(out: Path, build: Callable[[Path], Any]) -> bool:
    """``build(partial_dir)`` unless ``out`` exists, then rename into place; True when it built. The builder
    creates ``partial_dir`` itself (what an interrupted build left there is removed first)."""
    if out.is_dir():
        return False
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    build(partial)
    partial.rename(out)
    return True


def prepare_model(cfg, task, run_dir: Path) -> ModelDirs:
    """Rank 0: resolve ``cfg.model_path`` to model directories, building what is missing."""
    from sparse_rl_megatron.tasks import is_task_ref
    from sparse_rl_megatron.trainer.config import TINY_MODEL
    from sparse_rl_megatron.utils.file_checks import MEGATRON_META_FILE

    root = run_dir / MODEL_DIR
    init = root / "init"
    if cfg.model_path == TINY_MODEL:
        from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

        built = build_once(init, lambda d: save_tiny_hf_checkpoint(d, seed=cfg.seed, init_std=0.2))
        return ModelDirs(str(init), str(init), [f"{'built' if built else 'reusing'} tiny random Qwen2 in {init}"])
    if is_task_ref(cfg.model_path):
        notes = []
        if build_once(init, lambda d: task.build_model(d, seed=cfg.seed)):
            notes.append(f"built the {task.name} model in {init}")
        warm = root / "warm"

        def warm_start(d: Path) -> None:
            metrics = task.warm_start(init, d, seed=cfg.seed, **dict(cfg.warm_start))
            (d / WARM_METRICS).write_text(json.dumps(metrics, indent=2) + "\n")

        if build_once(warm, warm_start):
            notes.append(f"warm-started it into {warm}: {(warm / WARM_METRICS).read_text().strip()}")
        else:
            notes.append(f"reusing the warm-started model in {warm}")
        return ModelDirs(str(warm), str(warm), notes)
    if (Path(cfg.model_path) / MEGATRON_META_FILE).is_file():
        return ModelDirs(cfg.model_path, None)
    return ModelDirs(cfg.model_path, cfg.model_path)


def export_for_engine(learner, run_dir: Path) -> str:
    """Collective: the learner's weights as an HF directory ``model/hf`` for the engine (once)."""
    from sparse_rl_megatron.trainer.runtime import distributed as D

    out = run_dir / MODEL_DIR / "hf"
    if not D.on_main(out.is_dir):
        partial = out.with_name("hf.partial")
        learner.save_hf(partial)
        if D.is_main():
            partial.rename(out)
        D.wait_for_main()
    return str(out)
