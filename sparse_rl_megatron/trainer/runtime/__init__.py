"""What a training run needs around the RL step.

- ``run_plan``: ``preflight``, every check of a ``sparse-rl train`` config that can fail before a model loads
  (files, data, registries, world size, lengths), giving the ``RunPlan``.
- ``launch_preflight``: the ``sparse-rl preflight`` command (a launch checked on its node before torchrun).
- ``model_dirs``: which model directories a run trains from and samples with (task models, warm start, export).
- ``run_dir``: the run directory's lock (one run at a time, also ``sparse-rl experiment``'s) and the archive of an
  earlier run's outputs.
- ``distributed``: the control group, ``relay`` of a rank's failure, rank-0 helpers.
- ``prompts``: the resumable prompt order; ``signals``: stop requests (SIGTERM, SIGUSR1, SIGINT, a STOP file);
  ``progress``: heartbeat lines and step tables.
"""
