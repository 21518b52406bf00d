"""``sparse-rl train``: the Sparse-RL training loop and what a run needs around it.

The RL step, at the top:
- ``loop``: the driver, top to bottom: rollout, reward, dense recompute, correction, optimizer steps,
  weight sync, checkpoint, evaluation.
- ``step``: rollout -> reward -> dense recompute (+ reference) -> correction (the rejection rule and the
  reweighting: ``algo/``), reusable by other commands; ``optimize``: the optimizer steps of one rollout step.
- ``run``: set-up of a run (process groups, run directory, models, engines, rewards, data, resume) and the
  services the loop calls (log, save, sync, evaluate); ``evaluation``: held-out accuracy dense and sparse.
- ``config``: ``TrainConfig``, one typed section per component; ``cli``: the ``sparse-rl train`` command.

Grouped by concern:
- ``engines/``: the run's rollout engines on their ranks (``pool``), their threads (``worker``), the weight push
  to them (``EnginePool.sync``, ``colocated_weights``) and the probe that they serve it (``weight_probe``).
- ``checkpointing/``: save / find / prune (``checkpoints``), intact or not (``integrity``), ``resume``.
- ``runtime/``: checks before any model loads (``run_plan``, ``launch_preflight``), model directories
  (``model_dirs``), ranks (``distributed``), prompt order, stop signals, progress lines.

Heavy modules are imported by the functions that need them, so ``sparse-rl train`` rejects a bad config or a
missing file in seconds.
"""
