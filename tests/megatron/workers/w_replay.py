"""Routing replay (R3) in the learner, one process: a tiny Qwen3-MoE and a tiny Qwen2-MoE (shared expert, top-k of
the full softmax), fp32, the HF reference engine as the sampler.

usage: w_replay.py RESULT_DIR WORK_DIR

The checks are functions of ``test_routing_replay.py`` (launch ``replay``), per model:
- ``check_own``: replaying the experts the HF engine itself picks (its ``generate`` records them at prefill and decode)
  leaves the learner's log-probs where its own routers put them, within the float error model's bound (a token the
  two routers sent to different experts would move by orders of magnitude more).
- ``check_forced``: replaying *other* experts (each fed response token's HF choice shifted by one expert) gives the
  log-probs the HF engine computes with those experts forced (``teacher_forced(routing=...)``), within the float
  error model's bound, while the unreplayed learner is far from them: the recompute follows the given routes.
- ``check_train``: the training forward replays the same routes as the recompute: with pi_old from the replayed
  recompute and lr 0, the step's ratio is 1 (``loss/ppo_kl`` ~ 0, nothing clipped) and the router still gets a
  gradient; with the same pi_old but the routes dropped from the training batch the ratio moves.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

torch.set_num_threads(1)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # tests/ (numerics)


def main() -> None:
    from collections import defaultdict

    from mcore_worker import run_launch

    result_dir, work = sys.argv[1], Path(sys.argv[2])
    ctx = SimpleNamespace(work=work, states=defaultdict(dict))
    run_launch("replay", ["test_routing_replay"], ctx, result_dir, group_by="family")


if __name__ == "__main__":
    main()
