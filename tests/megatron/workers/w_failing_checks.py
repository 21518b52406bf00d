"""Worker of the harness's own test: the seeded failures of ``test_harness.py`` (launch ``failing`` under
torchrun, ``failing_alone`` in one process), to show that one failed check fails its test only.

usage: w_failing_checks.py RESULT_DIR LAUNCH
"""
from __future__ import annotations

import os
import sys


def main() -> None:
    import torch.distributed as dist

    from mcore_worker import run_launch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    run_launch(sys.argv[2], ["test_harness"], None, sys.argv[1])


if __name__ == "__main__":
    main()
