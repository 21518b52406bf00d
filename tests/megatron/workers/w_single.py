"""Single-process worker (TP = PP = DP = 1): the checks of the ``single`` launch, functions of the test files in
``MODULES`` (CPU compat, parity, log-probs, export, train step, NaN guard, resume from a checkpoint with optimizer
state, refusal of mismatched checkpoints, the planner vs the learner).

usage: w_single.py RESULT_DIR REF_PT WORK_DIR

The checks share ``ctx``: ``refs`` (the HF references), ``work`` (a folder for checkpoints), ``learners`` (those
that ``test_parity_and_logprobs.check_build`` builds, used by the later modules' checks) and ``state``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

torch.set_num_threads(1)

# In this order: cpu_compat first (nothing applied yet); the checks of a layout's learners (``layout``) run
# together, the untrained ones (parity, log-probs, export) before the train step.
MODULES = ["test_cpu_compat", "test_parity_and_logprobs", "test_checkpoints", "test_train_step", "test_plan_vs_learner"]


def main() -> None:
    import mcore_checks as C
    from mcore_worker import run_launch

    result_dir, ref_path, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    ctx = SimpleNamespace(refs=C.load_refs(ref_path), work=work, learners={}, state={})
    run_launch("single", MODULES, ctx, result_dir, group_by="layout")


if __name__ == "__main__":
    main()
