"""``sparse-rl train``: the Sparse-RL training loop and what a run needs around it.

The RL step, at the top:
- ``loop``: the driver, top to bottom: rollout, reward, dense recompute, correction, optimizer steps,
  weight sync, checkpoint, evaluation.
- ``step``: rollout -> reward -> dense recompute (+ reference) -> correction (the rejection rule and the
  reweighting: ``algo/``), reusable by other commands; ``optimize``: the optimizer steps of one rollout step.
- ``run``: set-up of a run (process groups, run directory, models, engines, rewards, data, resume) and the
  services the loop calls (log, save, sync, evaluate); ``evaluation``: held-out accuracy dense and sparse.
- ``config``: ``TrainConfig``, one typed section per component; ``cli``: the ``sparse-rl train`` command.
- ``run_plan``: checks of a config before any model loads; ``launch_preflight``: ``sparse-rl preflight``, the
  checks of a launch on a node before torchrun starts.

Grouped by concern:
- ``engine_pool/``: the run's rollout engines on their ranks (``pool``), their threads (``worker``), the weight push
  to them (``EnginePool.sync``, ``colocated_weights``) and the probe that they serve it (``weight_probe``).
- ``checkpointing/``: save / find / prune (``checkpoints``), intact or not (``integrity``), ``resume``.
- ``runtime/``: model directories (``model_dirs``), ranks (``distributed``), the run directory (``run_dir``),
  prompt order, stop signals, progress lines, the learner's and engines' device turns (``device_turns``), the
  documented result a run is checked against (``expected_result``).

Heavy modules are imported by the functions that need them, so ``sparse-rl train`` rejects a bad config or a
missing file in seconds.
"""
