"""``sparse-rl train``: the Sparse-RL training loop and what a run needs around it.

- ``config``: ``TrainConfig``, one typed section per component.
- ``preflight``: every check that can fail before a model loads (files, data, registries, world size).
- ``loop``: the driver, top to bottom: rollout, reward, dense recompute, correction, optimizer steps,
  weight sync, checkpoint, evaluation.
- ``step``: rollout -> reward -> dense recompute (+ reference) -> correction, reusable by other commands.
- ``run``: set-up of a run (process groups, run directory, models, engines, rewards, data, resume).
- ``engine_pool``: the run's engines on their ranks (``rollout/layout.py``): sharded rollout and evaluation,
  weights to every engine, the probe on each, failures relayed to every rank; ``engine_worker``: an engine's
  calls on its own thread with the phase deadline; ``colocated_weights``: per-TP-rank payloads of an engine
  that spans several GPUs.
- ``engines``: rollout engines by name; ``weight_sync``: the probe sequence and tolerances;
  ``evaluation``: held-out accuracy dense and sparse; ``checkpoints``: save / find / prune / resume state;
  ``prompts``: the resumable prompt order; ``signals``: stop requests (SIGTERM, SIGUSR1, SIGINT, a STOP file);
  ``distributed``: the control group, ``relay`` of a rank's failure, rank-0 helpers; ``progress``: heartbeat
  lines and step tables.

Heavy modules are imported by the functions that need them, so ``sparse-rl train`` rejects a bad config or a
missing file in seconds.
"""
