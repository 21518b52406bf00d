"""Which model directories a run trains from and samples with (rank 0 builds what has to be built).

- an HF directory: the learner loads it and the engine serves it;
- a sparse-rl Megatron checkpoint: the learner loads it; the engine gets an HF export of it (``model/hf``);
- ``tiny`` (``tiny-qwen3-moe``, ``tiny-qwen2-moe``): a random tiny Qwen2 (Qwen3-MoE, Qwen2-MoE) + byte-level
  tokenizer, built once in ``model/init``;
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

from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.tasks import HELDOUT_SEED, is_task_ref
from sparse_rl_megatron.tasks.sft import StopCheck
from sparse_rl_megatron.tasks.warm_check import check_warm_start
from sparse_rl_megatron.trainer.config import TINY_MODELS
from sparse_rl_megatron.trainer.runtime import distributed as D
from sparse_rl_megatron.utils.atomic_write import write_json_atomic
from sparse_rl_megatron.utils.errors import RunFailed
from sparse_rl_megatron.utils.file_checks import MEGATRON_META_FILE

MODEL_DIR = "model"
WARM_METRICS = "warm_start.json"
WARM_CHECK = "warm_check.json"
"""Under ``model/``: each warm-start attempt's check (``checked_warm_start``)."""


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


def prepare_model(cfg, task, run_dir: Path, should_stop: StopCheck | None = None) -> ModelDirs:
    """Rank 0: resolve ``cfg.model_path`` to model directories, building what is missing. ``should_stop``: the run's
    stop request, asked during a task's warm start (minutes), which then ends with ``StoppedEarly`` and keeps nothing
    of the interrupted attempt (a re-run builds it again; the model it starts from is kept)."""
    root = run_dir / MODEL_DIR
    init = root / "init"
    if cfg.model_path in TINY_MODELS:
        from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

        family = TINY_MODELS[cfg.model_path]
        built = build_once(init, lambda d: save_tiny_hf_checkpoint(d, family, seed=cfg.seed, init_std=0.2))
        return ModelDirs(str(init), str(init), [f"{'built' if built else 'reusing'} tiny random {family} in {init}"])
    if is_task_ref(cfg.model_path):
        notes = []
        if build_once(init, lambda d: task.build_model(d, seed=cfg.seed)):
            notes.append(f"built the {task.name} model in {init}")
        warm = root / "warm"
        checked = cfg.warm_check.enabled and task.warm_expectations is not None
        if warm.is_dir():
            notes.append(f"reusing the warm-started model in {warm}{_recorded_verdict(cfg, root)}")
        elif checked:
            notes += checked_warm_start(cfg, task, init, warm, should_stop)
        else:
            build_once(warm, lambda d: _warm_start(cfg, task, init, d, should_stop))
            notes.append(f"warm-started it into {warm}: {(warm / WARM_METRICS).read_text().strip()}")
        return ModelDirs(str(warm), str(warm), notes)
    if (Path(cfg.model_path) / MEGATRON_META_FILE).is_file():
        return ModelDirs(cfg.model_path, None)
    return ModelDirs(cfg.model_path, cfg.model_path)


def _warm_start(cfg, task, init: Path, out: Path, should_stop: StopCheck | None = None) -> None:
    """The task's warm start of ``init`` into ``out`` (created) with the run's seed, unchecked; its metrics go to
    ``out/warm_start.json``."""
    metrics = task.warm_start(init, out, seed=cfg.seed, should_stop=should_stop, **dict(cfg.warm_start))
    (out / WARM_METRICS).write_text(json.dumps(metrics, indent=2) + "\n")


def _settings(cfg) -> dict[str, Any]:
    """What a warm start is built from, recorded with its verdicts: a re-run with other settings is told."""
    return {"seed": cfg.seed, "warm_start": dict(cfg.warm_start), "attempts": cfg.warm_check.attempts}


def _recorded_verdict(cfg, root: Path) -> str:
    """For the reuse note: the recorded check of the warm start, and whether it was built with other settings."""
    record = _read_record(root)
    if record is None:
        return " (built without its check)"
    attempt = next((a for a in record["attempts"] if a["passed"]), None)
    note = (f" (check passed at attempt {attempt['attempt']}, warm-start seed {attempt['seed']})" if attempt
            else " (its check did not pass)")
    if record.get("settings") != _settings(cfg):
        note += (f"; built with {record.get('settings')}, this run asks {_settings(cfg)}: remove {root / 'warm'} "
                 f"to build it again")
    return note


def _read_record(root: Path) -> dict[str, Any] | None:
    path = root / WARM_CHECK
    return json.loads(path.read_text()) if path.is_file() else None


def checked_warm_start(cfg, task, init: Path, warm: Path, should_stop: StopCheck | None = None) -> list[str]:
    """Warm-start ``init`` into ``warm`` and check it against the task's expectations (``tasks/warm_check.py``: dense,
    and with the compressed cache the run samples with, ``rollout.compression``); on a miss, again with the next seed
    (``WarmCheckConfig.seed``), up to ``cfg.warm_check.attempts`` in all. Every attempt's verdict goes to
    ``model/warm_check.json`` with the settings it was built with; a missed model is kept as ``warm.missed-<attempt>``
    (and said at once). Raises ``RunFailed`` when every attempt missed, at once when a run with the same settings
    already found that (the same seeds miss the same way). A run stopped between attempts goes on at the next one:
    the attempts its record holds as missed, with the same settings and their models kept, are not built again (the
    same seed misses the same way; minutes each). Returns the notes to print."""
    expected, attempts, settings = task.warm_expectations, cfg.warm_check.attempts, _settings(cfg)
    earlier = _read_record(warm.parent)
    if earlier is not None and earlier.get("verdict") == "missed" and earlier.get("settings") == settings:
        raise RunFailed(_all_missed(task, earlier, warm.parent, "already, with these settings"))
    options = dict(cfg.warm_start)
    options.setdefault("eval_problems", 0)  # the check scores the held-out records itself
    record: dict[str, Any] = {"task": task.name, "settings": settings, "attempts": [], "rule": (
        f"warm start again with seed + {cfg.warm_check.seed(0, 1)} x attempt on a miss, {attempts} attempts in all, "
        "then stop")}
    notes = []
    done = _missed_before(earlier, settings, warm)
    if done:
        record["attempts"] = earlier["attempts"][:done]
        which = f"attempts 1-{done}" if done > 1 else "attempt 1"
        notes.append(f"{which} of an earlier run with these settings missed the check (kept as "
                     f"{warm.name}.missed-*): going on at attempt {done + 1}")
        print(notes[-1], flush=True)
    for attempt in range(done, attempts):
        seed = cfg.warm_check.seed(cfg.seed, attempt)
        partial = warm.with_name(warm.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        metrics = {**task.warm_start(init, partial, seed=seed, should_stop=should_stop, **options)}
        check = check_warm_start(task, partial, expected, metrics[MN.SFT_LOSS_LAST], seed=HELDOUT_SEED,
                                 compression=cfg.rollout.compression, temperature=cfg.rollout.sampling.temperature)
        metrics.update({MN.SFT_HELDOUT_ACC: check.measured["heldout_accuracy"], MN.SFT_SEED: float(seed),
                        **{f"check/{k}": v for k, v in check.measured.items()}, MN.CHECK_PASSED: float(check.passed)})
        write_json_atomic(partial / WARM_METRICS, _finite(metrics))
        record["attempts"].append({"attempt": attempt + 1, "seed": seed, **_finite(check.to_json())})
        record["verdict"] = "passed" if check.passed else ("missed" if attempt + 1 == attempts else "retrying")
        write_json_atomic(warm.parent / WARM_CHECK, record)
        where = f"attempt {attempt + 1} of {attempts}, warm-start seed {seed}"
        if check.passed:
            partial.rename(warm)
            return [*notes, f"warm-started it into {warm} ({where}); check {check.summary()}"]
        missed = warm.with_name(f"{warm.name}.missed-{attempt + 1}")
        shutil.rmtree(missed, ignore_errors=True)
        partial.rename(missed)
        # said now, not with the notes: the next attempt takes minutes
        print(f"warm start {where} {check.summary()}; kept as {missed}", flush=True)
    raise RunFailed(_all_missed(task, record, warm.parent, ""))


def _missed_before(earlier: dict[str, Any] | None, settings: dict[str, Any], warm: Path) -> int:
    """How many leading attempts an earlier run with the same ``settings`` recorded as missed, each with its model
    kept (``warm.missed-<k>``), while it was still retrying; 0 for anything else."""
    if earlier is None or earlier.get("verdict") != "retrying" or earlier.get("settings") != settings:
        return 0
    done = 0
    for k, a in enumerate(earlier.get("attempts", []), start=1):
        if a.get("attempt") != k or a.get("passed") or not warm.with_name(f"{warm.name}.missed-{k}").is_dir():
            break
        done = k
    return done


def _all_missed(task, record: dict[str, Any], root: Path, when: str) -> str:
    last = record["attempts"][-1]
    return (f"the warm start of {task.name} missed its check on all {len(record['attempts'])} attempts"
            f"{' ' + when if when else ''} (last: {'; '.join(last['missed'])}); verdicts in {root / WARM_CHECK}. "
            f"Try more supervised steps (warm_start.steps=...), more attempts (warm_check.attempts=...), or no check "
            f"(warm_check.enabled=false)")


def _finite(value: Any) -> Any:
    """``value`` with every nan float as None (JSON has no NaN: a share over no records is written as null)."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def export_for_engine(learner, run_dir: Path) -> str:
    """Collective: the learner's weights as an HF directory ``model/hf`` for the engine (once)."""
    out = run_dir / MODEL_DIR / "hf"
    if not D.on_main(out.is_dir):
        partial = out.with_name("hf.partial")
        learner.save_hf(partial)
        if D.is_main():
            partial.rename(out)
        D.wait_for_main()
    return str(out)
