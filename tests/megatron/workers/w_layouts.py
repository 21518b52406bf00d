"""Multi-rank worker (torchrun, gloo): the checks of the ``pair`` (2 ranks) or ``grid`` (4 ranks) launch, functions
of the test files in ``MODULES``: the same checks at each TP x PP layout of the launch (``LAYOUTS`` of
``mcore_harness.py``; the rest of the world is data parallel), plus the launch's own checks (NaN guard at PP = 2,
DistributedOptimizer, bf16 export at PP = 2, sequence parallel, the planner vs the learner, a one-row batch at
DP >= 2, learner.offload, resharding a TP = 1 checkpoint).

usage: w_layouts.py RESULT_DIR LAUNCH REF_PT WORK_DIR [TP1_CHECKPOINT]

The checks share ``ctx``: ``refs``, ``work``, ``learners`` (the current layout's, built by
``test_parity_and_logprobs.check_build``) and ``tp1_ckpt`` (the grid launch's checkpoint to reshard).
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

torch.set_num_threads(1)

# The checks of one layout run together (``layout``), the untrained ones before the train step; then the rest.
MODULES = ["test_parity_and_logprobs", "test_checkpoints", "test_train_step", "test_plan_vs_learner", "test_offload"]


def main() -> None:
    import mcore_checks as C
    from mcore_worker import run_launch

    result_dir, launch, ref_path, work = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    ctx = SimpleNamespace(refs=C.load_refs(ref_path), work=work, learners={},
                          tp1_ckpt=sys.argv[5] if len(sys.argv) > 5 else None)
    run_launch(launch, MODULES, ctx, result_dir, group_by="layout")


if __name__ == "__main__":
    main()
