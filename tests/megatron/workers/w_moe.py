"""Mixture-of-experts worker (torchrun, gloo): the checks of the ``moe_pair`` (2 ranks) or ``moe_grid`` (4 ranks)
launch, functions of the test files in ``MODULES``: the MoE models of ``moe_reference.py`` at the launch's TP x PP x
EP layouts (``MOE_PAIR_LAYOUTS``, ``MOE_GRID_LAYOUTS``), the load-balancing step, uneven micro-batch counts, the
planner vs the learner, W11-W13, learner.offload at EP 2, resharding a TP = 1 checkpoint of Qwen3-MoE.

usage: w_moe.py RESULT_DIR LAUNCH MOE_REF_PT WORK_DIR [TP1_CHECKPOINT]
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

torch.set_num_threads(1)

# The checks of one layout run together (``layout``); cpu_compat_moe after MoE models ran forward and backward.
MODULES = ["test_moe_parity", "test_offload"]


def main() -> None:
    import mcore_checks as C
    from mcore_worker import run_launch

    result_dir, launch, ref_path, work = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    ctx = SimpleNamespace(refs=C.load_refs(ref_path), work=work, learners={},
                          tp1_ckpt=sys.argv[5] if len(sys.argv) > 5 else None)
    run_launch(launch, MODULES, ctx, result_dir, group_by="layout")


if __name__ == "__main__":
    main()
