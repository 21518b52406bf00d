"""Worker of the harness's own test: seeded failures, to show that one failed check fails its test only.

usage: w_failing_checks.py RESULT_DIR
  mismatch        an ``expect`` fails between two collectives: the check runs to its end on every rank
  after_mismatch  a collective after it: runs and passes
  crash           (one process only) an exception: fails its check only
  after_crash     (one process only) runs and passes
"""
from __future__ import annotations

import os
import sys

import torch


def main() -> None:
    import torch.distributed as dist

    from mcore_worker import expect, run_checks

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")

    def total(x: float) -> float:
        t = torch.tensor([x])
        if world > 1:
            dist.all_reduce(t)
        return t.item()

    def mismatch():
        diff = total(0.5)  # a seeded defect: every rank sees a difference of 0.5 * world
        expect(diff <= 0.1, f"seeded mismatch {diff} > 0.1")
        expect(total(1.0) == world, "the collective after the failed comparison ran on every rank")

    def after_mismatch():
        assert total(1.0) == world

    checks = [("mismatch", mismatch), ("after_mismatch", after_mismatch)]
    if world == 1:
        def crash():
            raise RuntimeError("seeded crash")

        checks += [("crash", crash), ("after_crash", lambda: None)]
    run_checks(checks, sys.argv[1])


if __name__ == "__main__":
    main()
