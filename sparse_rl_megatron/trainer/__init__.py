"""``sparse-rl train``: the Sparse-RL training loop and what a run needs around it.

- ``config``: ``TrainConfig``, one typed section per component.
- ``preflight``: every check that can fail before a model loads (files, data, registries, world size).
- ``loop``: the driver, top to bottom: rollout, reward, dense recompute, correction, optimizer steps,
  weight sync, checkpoint, evaluation.
- ``step``: rollout -> reward -> dense recompute (+ reference) -> correction, reusable by other commands.
- ``run``: set-up of a run (process groups, run directory, models, engine, reward, data, resume).
- ``engines``: rollout engines by name; ``weight_sync``: buckets to the engine and the log-prob probe;
  ``evaluation``: held-out accuracy dense and sparse; ``checkpoints``: save / find / prune / resume state;
  ``prompts``: the resumable prompt order; ``signals``: stop requests (SIGTERM, SIGUSR1, SIGINT, a STOP file);
  ``distributed``: rank-0-drives-the-engine helpers; ``progress``: heartbeat lines and step tables.

Heavy modules are imported by the functions that need them, so ``sparse-rl train`` rejects a bad config or a
missing file in seconds.
"""
