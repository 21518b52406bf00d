"""Where an experiment keeps each seed's and each arm's files (the layout in ``runner.py``'s docstring), and the
training config of an arm: what the stage modules (``runner``, ``budget_rule``, ``control``, ``study``,
``results``) share, so none of them imports another's driver."""
from __future__ import annotations

import json
from pathlib import Path

from sparse_rl_megatron.experiment.arms import ArmRun
from sparse_rl_megatron.experiment.config import ExperimentConfig
from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.utils.config_io import deep_merge, from_dict, to_dict

ARM_RECIPE = "arm.yaml"
ARM_DONE = "arm_done.json"
ARM_USAGE = "arm_usage.json"
"""CPU and wall seconds of an arm's processes so far (summed over a stopped and a resumed run)."""
EXPERIMENT_FILE = "experiment.yaml"


def seed_dir(cfg: ExperimentConfig, seed: int) -> Path:
    return Path(cfg.experiment.out) / f"seed_{seed}"


def arm_train_config(cfg: ExperimentConfig, run: ArmRun, seed: int, model_dir: str | Path | None = None
                     ) -> TrainConfig:
    """The ``TrainConfig`` of ``run`` for ``seed``: the base recipe + the arm's overrides, its budget, its run
    directory, and the seed's warm start as the model (``model_dir``; None keeps the task reference). An arm
    with a budget ``level`` runs at ``experiment.level_budgets[level]`` (with the adaptive budget: its start). The
    ``sparse`` evaluation of every arm uses the base recipe's rollout compression unless ``eval.compression``
    is set, so all arms are evaluated under the same compressed cache."""
    data = to_dict(cfg.train)
    if data["eval"]["compression"] is None:
        data["eval"]["compression"] = data["rollout"]["compression"]
    data = deep_merge(data, run.spec.overrides)
    if run.budget is not None:
        data["rollout"]["compression"]["budget"] = run.budget
    elif run.spec.harsh and cfg.experiment.harsh_budget:  # unset (before the budget rule): refused by the runner
        data["rollout"]["compression"]["budget"] = cfg.experiment.harsh_budget
    elif run.spec.level in cfg.experiment.level_budgets:  # unknown (before the rule): refused by the runner
        data["rollout"]["compression"]["budget"] = cfg.experiment.level_budgets[run.spec.level]
    data.update(seed=seed, run_dir=str(seed_dir(cfg, seed) / run.name))
    if model_dir is not None:
        data.update(model_path=str(model_dir), warm_start={})
    return from_dict(TrainConfig, data, f"experiment arm {run.name}")


def read_json(path: Path, default=None):
    return json.loads(path.read_text()) if path.is_file() else default
