"""A small ``Task`` for the trainer's ``task:<name>`` wiring tests, registered as ``task:tiny_sums`` when imported
(``plugins: [train_task_plugin]`` with this folder on PYTHONPATH).

Problems ``a + b`` with a gold answer; the model is the random tiny Qwen2 of ``models.tiny``; the warm start
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
    response_tokens = 8

    def records(self, split, limit=None, seed=0):
        rng = random.Random(f"{split}/{seed}")
        pairs = [(a, b) for a in range(10) for b in range(10) if (a + b) % 4 == (0 if split == "heldout" else 1)]
        rng.shuffle(pairs)
        rows = [MathRecord(prompt=f"{a} + {b} =", answer=str(a + b), source_id=f"{a}+{b}", dataset=self.name)
                for a, b in pairs[:limit]]
        return Dataset(self.name, f"task:{self.name}/{split}", rows)

    def build_model(self, out_dir, *, seed=0):
        from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

        return save_tiny_hf_checkpoint(out_dir, seed=seed, init_std=0.2)

    def warm_start(self, model_dir, out_dir, *, seed=0, should_stop=None, **options):
        shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
        (Path(out_dir) / "warm_options.json").write_text(json.dumps(options))
        return {"warm/copied": 1.0, "warm/options": float(len(options))}


if "tiny_sums" not in TASKS:
    TASKS.add("tiny_sums", TinySums())


# ------------------------------------------------------------------------------------------------------------
# ``reward: parity``: 1 when the response has an even number of characters. A random model gets a mixed signal in
# every group (non-zero advantages), so runs really train and their weights move.
from sparse_rl_megatron.rewards.registry import REWARDS  # noqa: E402
from sparse_rl_megatron.rewards.reward import SampleReward  # noqa: E402
from sparse_rl_megatron.rewards.verify import Verdict  # noqa: E402


class ParityReward(SampleReward):
    def score(self, responses, golds, styles="boxed"):
        return [Verdict(1.0, "correct", r) if len(r) % 2 == 0 else Verdict(0.0, "wrong", r) for r in responses]


if "parity" not in REWARDS:
    REWARDS.add("parity", ParityReward)


# ------------------------------------------------------------------------------------------------------------
# ``rollout.engine: flaky``: the reference engine, except that on rank ``fail_rank`` (every rank if unset) its
# ``fail_at``-th rollout fails (an engine that died) or its ``hang_at``-th one never returns (a hung engine), and
# that on rank ``fail_start`` it does not start;
# ``record: DIR`` writes every sample it generates to DIR/rank<r>.jsonl (what the engines sampled, for tests).
import json as _json  # noqa: E402
import os as _os  # noqa: E402
import threading as _threading  # noqa: E402

from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from sparse_rl_megatron.rollout.engine_registry import ENGINES, EngineSpec  # noqa: E402


class FlakyEngine(HFRolloutEngine):
    def __init__(self, *args, fail_at: int = 0, hang_at: int = 0, fail_rank: int | None = None, record: str = "",
                 fail_start: int | None = None, **kwargs):
        rank = int(_os.environ.get("RANK", "0"))
        if fail_start == rank:
            raise OSError("no GPU memory left for the engine (simulated)")
        super().__init__(*args, **kwargs)
        mine = fail_rank is None or fail_rank == rank
        self.fail_at, self.hang_at = (fail_at, hang_at) if mine else (0, 0)
        self.calls = 0
        self.record = Path(record) / f"rank{rank}.jsonl" if record else None

    def generate(self, prompts, n, sampling, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("engine process is gone (simulated)")
        if self.calls == self.hang_at:
            _threading.Event().wait()  # never set: the engine hangs
        samples = super().generate(prompts, n, sampling, **kwargs)
        if self.record is not None:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            with self.record.open("a") as f:
                for x in samples:
                    f.write(_json.dumps({"call": self.calls, "group": x.group_id, "index": x.index_in_group,
                                         "seed": sampling.seed, "tokens": x.response_ids,
                                         "logprobs": x.sampler_logprobs.tolist(), "version": x.weight_version}) + "\n")
        return samples


def _build_flaky(build):
    import torch

    options = dict(build.options)
    return FlakyEngine(build.model_dir, compression=build.compression, dtype=getattr(torch, build.dtype),
                       max_batch_size=build.max_batch_size, show_progress=build.show_progress,
                       fail_at=int(options.get("fail_at", 0)), hang_at=int(options.get("hang_at", 0)),
                       fail_rank=options.get("fail_rank"), record=str(options.get("record", "")),
                       fail_start=options.get("fail_start"))


if "flaky" not in ENGINES:
    ENGINES.add("flaky", EngineSpec(build=_build_flaky))
