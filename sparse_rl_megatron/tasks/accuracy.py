"""Greedy accuracy of a model on a task's problems, with a dense or a compressed KV cache.

What the warm start reports at its end, and how the prototype and the docs measure held-out accuracy under
dense and sparse inference. Greedy (temperature 0) makes an evaluation a fixed function of the weights.
"""
from __future__ import annotations

import os
from typing import Sequence

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.data.templates import render_prompt
from sparse_rl_megatron.rewards.registry import REWARDS
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
from sparse_rl_megatron.tasks.base import Task


def score_records(task: Task, engine, records: Sequence[MathRecord], max_new_tokens: int,
                  temperature: float = 0.0, n: int = 1, seed: int = 0) -> dict[str, float]:
    """Generate ``n`` responses per record with ``engine`` and score them with the task's reward.

    Returns ``acc`` (mean reward), ``len`` (mean response tokens) and ``no_answer`` (fraction without an answer).
    """
    prompts = [render_prompt(task.template, r.prompt, engine.tokenizer) for r in records]
    samples = engine.generate(prompts, n, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                                         seed=seed))
    for s in samples:
        s.metadata.update(records[s.group_id].metadata())
    with REWARDS.get(task.reward)() as reward:
        verdicts = reward.score_samples(samples)
    count = len(samples)
    return {"acc": sum(v.reward for v in verdicts) / count,
            "len": sum(s.response_length for s in samples) / count,
            "no_answer": sum(v.reason == "no_answer" for v in verdicts) / count}


def heldout_accuracy(task: Task, model_dir: str | os.PathLike, *, compression: CompressionConfig | None = None,
                     limit: int | None = None, seed: int = 0, max_new_tokens: int | None = None) -> float:
    """Greedy accuracy on the first ``limit`` held-out problems (``max_new_tokens`` default: the task's
    ``response_tokens`` + 8)."""
    engine = HFRolloutEngine(model_dir, compression=compression, show_progress=False)
    if max_new_tokens is None:
        max_new_tokens = task.response_tokens + 8
    return score_records(task, engine, task.records("heldout", limit=limit, seed=seed), max_new_tokens)["acc"]
