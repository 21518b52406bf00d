"""A small ``Task`` for the trainer's ``task:<name>`` wiring tests, registered as ``task:tiny_sums`` when imported
(``plugins: [train_task_plugin]`` with this folder on PYTHONPATH).

Problems ``a + b`` with a gold answer; the model is the random tiny Qwen2 of ``utils.tiny_models``; the warm start
copies the built model and records the options it was given (this tests the wiring, not learning).
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from sparse_rl_megatron.data.loader import Dataset
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.tasks import TASKS, Task


class TinySums(Task):
    name = "tiny_sums"
    description = "a + b for small a, b (trainer wiring tests)"
    template = "plain"
    reward = "math"

    def records(self, split, limit=None, seed=0):
        rng = random.Random(f"{split}/{seed}")
        pairs = [(a, b) for a in range(10) for b in range(10) if (a + b) % 4 == (0 if split == "heldout" else 1)]
        rng.shuffle(pairs)
        rows = [MathRecord(prompt=f"{a} + {b} =", answer=str(a + b), source_id=f"{a}+{b}", dataset=self.name)
                for a, b in pairs[:limit]]
        return Dataset(self.name, f"task:{self.name}/{split}", rows)

    def build_model(self, out_dir, *, seed=0):
        from sparse_rl_megatron.utils.tiny_models import save_tiny_hf_checkpoint

        return save_tiny_hf_checkpoint(out_dir, seed=seed, init_std=0.2)

    def warm_start(self, model_dir, out_dir, *, seed=0, **options):
        shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
        (Path(out_dir) / "warm_options.json").write_text(json.dumps(options))
        return {"warm/copied": 1.0, "warm/options": float(len(options))}


if "tiny_sums" not in TASKS:
    TASKS.add("tiny_sums", TinySums())


# ------------------------------------------------------------------------------------------------------------
# ``rollout.engine: flaky``: the reference engine, except that its ``fail_at``-th rollout fails (an engine that died).
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from sparse_rl_megatron.trainer.engines import ENGINES, EngineSpec  # noqa: E402


class FlakyEngine(HFRolloutEngine):
    def __init__(self, *args, fail_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_at, self.calls = fail_at, 0

    def generate(self, prompts, n, sampling):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("engine process is gone (simulated)")
        return super().generate(prompts, n, sampling)


def _build_flaky(model_dir, rollout, show_progress):
    import torch

    return FlakyEngine(model_dir, compression=rollout.compression, dtype=getattr(torch, rollout.dtype),
                       max_batch_size=rollout.max_batch_size, show_progress=show_progress,
                       fail_at=int(rollout.engine_options["fail_at"]))


if "flaky" not in ENGINES:
    hf = ENGINES.get("hf")
    ENGINES.add("flaky", EngineSpec(build=_build_flaky, with_compression=hf.with_compression,
                                    dense_logprobs=hf.dense_logprobs))
