"""What a task built in code provides: problems, the reward they are scored with, and a model that can learn them.

Math data sets come from files (``sparse_rl_megatron.data``) and are trained from a given HF model. A *task* is
self-contained instead, for runs that must learn in minutes on a laptop CPU and for controlled experiments: it
generates its problems (train and held-out splits that never overlap), builds a tiny HF model with its own
tokenizer (no download), and warm-starts it with a short supervised stage so RL starts from a policy that
sometimes succeeds. Everything downstream (rollout engines, the Megatron learner, rewards, eval) treats the
result like any HF model directory and any data set.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparse_rl_megatron.data.loader import Dataset
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.tasks.warm_check import WarmStartExpectations

if TYPE_CHECKING:
    from sparse_rl_megatron.tasks.sft import StopCheck

SPLITS = ("train", "heldout")
HELDOUT_SEED = 0
"""Seed of a task's held-out problems in every evaluation (training runs, ``sparse-rl eval``): the same evaluation set
whatever the training seed."""


class Task(ABC):
    """A generated problem family with its model recipe. Subclasses are registered in ``tasks.TASKS``."""

    name: str
    """Registry name (``task:<name>`` in configs)."""
    description: str = ""
    """One line for ``--help`` and logs."""
    template: str = "plain"
    """Prompt template name (``data.TEMPLATES``) applied to each record's ``prompt``."""
    reward: str = "exact"
    """Reward name (``rewards.REWARDS``) the responses are scored with."""
    warm_expectations: WarmStartExpectations | None = None
    """What a good warm start of this task does, checked after the supervised stage (``tasks/warm_check.py``; the
    task's records then carry their worked chain and its ``response_tokens`` bounds a response); None: unchecked."""

    @property
    @abstractmethod
    def response_tokens(self) -> int:
        """Tokens of a correct response, EOS included (the least ``max_new_tokens`` that lets one finish)."""

    @abstractmethod
    def records(self, split: str, limit: int | None = None, seed: int = 0) -> Dataset:
        """Problems of ``split`` (one of ``SPLITS``): deterministic for a seed, train and held-out disjoint."""

    @abstractmethod
    def build_model(self, out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
        """Write a randomly initialised HF model directory (config, safetensors, tokenizer) to ``out_dir``."""

    @abstractmethod
    def warm_start(self, model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0,
                   should_stop: StopCheck | None = None, **options: Any) -> dict[str, float]:
        """Supervised training of ``model_dir`` on worked solutions of train problems; writes the trained HF
        model directory to ``out_dir`` and returns its metrics (loss, steps, seconds, held-out accuracy).
        ``should_stop``: asked before every step (a run's stop request); a reason ends it with ``StoppedEarly``."""

    def trivial_answers(self, record: MathRecord) -> dict[str, str | None]:
        """``{policy name: answer}`` of the trivial policies this task makes tempting, for one record (values read
        off the prompt, a chain's start...; None: no answer). The shortcut audit (``tasks/audit.py``) adds the
        constant answers and the most common one; a task without tempting functions returns ``{}``."""
        return {}
