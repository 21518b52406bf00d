"""GPU acceptance kit: the learner and the reference engine measured on one GPU, every part time-boxed.

One command on a lent device (bench/README.md, "GPU acceptance kit"): ``bash bench/gpu_check.sh``, which runs

    python bench/gpu_check.py --out "$OUT"          # H200 sizes, about 7.5 minutes at most
    python bench/gpu_check.py --cpu --out DIR       # the same code at toy sizes on the CPU (CI: about a minute)
    python bench/gpu_check.py --estimate            # the expected H200 seconds per part, next to its box

Parts (``gpu_kit/``), each in its own process: carried-wheel set-up, ``model`` (random Qwen2.5-1.5B-shaped HF
checkpoint, torch.compile probe), ``logprobs`` (learner fp32 / bf16 vs HF), ``lm_head_memory`` (chunked vs
unchunked LM head), ``train`` and ``train_recompute`` (tokens/s, MFU, distributed optimizer, checkpoint save +
load; ``train`` also ``learner.offload: all`` through a colocated step's turns: allocated bytes asleep / weights
only / awake against the plan's ``learner_resident_bytes``, sleep and wake seconds), ``engine`` (HF reference engine dense vs R-KV vs SnapKV). Results: ``OUT/results.json`` and
``OUT/results.md``, rewritten after every part; raw records in ``OUT/records.jsonl``; logs in ``OUT/logs/``.
The exit code is 0 only when every part is ok.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kit.sizes import PARTS, preset  # noqa: E402

FORBIDDEN_IMPORTS = ("math_verify", "sglang", "sgl_kernel", "flashinfer", "transformer_engine")
"""Absent on the device: a part that imports one (here, where they may be installed) fails its check."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="toy sizes on the CPU (CUDA hidden from the parts)")
    p.add_argument("--out", help="results folder (default: $OUT, else runs/gpu_check)")
    p.add_argument("--work", help="scratch folder for the model, the installed wheels and the checkpoint "
                                  "(default: <tmp>/sparse-rl-gpu-check-{gpu,cpu}; never inside --out)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run, in this order")
    p.add_argument("--deadline", type=float, help="seconds for the whole run (default: the sum of the boxes)")
    p.add_argument("--estimate", action="store_true", help="print the H200 time estimate per part and exit")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    p.add_argument("--no-jit-fusions", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_part(args) -> int:
    """One part, in this process (started by the driver)."""
    import torch

    from gpu_kit.records import Recorder

    sizes = preset(args.cpu)
    if args.cpu:
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; use --cpu for the toy sizes on the CPU")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    deadline = time.monotonic() + (args.deadline_at - time.time()) - 2  # 2 s to write the last record
    rec = Recorder(args.out, args.part, deadline)
    work, fusions = Path(args.work), not args.no_jit_fusions
    if args.part == "model":
        import shutil

        from gpu_kit import part_model

        shutil.rmtree(work / part_model.MODEL_DIR, ignore_errors=True)
        part_model.run(rec, sizes, work, device)
    elif args.part == "engine":
        from gpu_kit import part_engine

        part_engine.run(rec, sizes, work, device)
    else:
        from gpu_kit import part_learner

        if args.part == "logprobs":
            part_learner.run_logprobs(rec, sizes, work, device, fusions)
        elif args.part == "lm_head_memory":
            part_learner.run_lm_head_memory(rec, sizes, work, device, fusions)
        else:
            part_learner.run_train(rec, sizes, work, device, fusions, recompute=args.part == "train_recompute")
    found = sorted({name.split(".")[0] for name in sys.modules} & set(FORBIDDEN_IMPORTS))
    rec.write("imports none of " + "/".join(FORBIDDEN_IMPORTS), ok=not found, found=found)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:
        return run_part(args)
    if args.estimate:
        from gpu_kit import estimate

        print(estimate.table())
        return 0
    from gpu_kit import driver

    out = Path(args.out or os.environ.get("OUT") or driver.ROOT / "runs" / "gpu_check").resolve()
    work = Path(args.work or Path(tempfile.gettempdir()) / f"sparse-rl-gpu-check-{'cpu' if args.cpu else 'gpu'}")
    if work.resolve() == out or out in work.resolve().parents:
        raise SystemExit(f"gpu_check: --work {work} must not be inside --out {out} (the results travel back)")
    parts = [p for p in PARTS if p in args.parts]
    return driver.run(preset(args.cpu), args.cpu, out, work.resolve(), parts, args.deadline)


if __name__ == "__main__":
    sys.exit(main())
