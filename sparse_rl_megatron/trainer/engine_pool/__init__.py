"""The run's rollout engines, as the trainer drives them (the engines themselves: ``rollout/``).

- ``pool``: ``EnginePool``, every rank's part in the run's engines (``rollout/layout.py`` places them): sharded
  generation and scoring, the weight push to every engine (``EnginePool.sync``) and the probe on each
  (``EnginePool.probe``), memory release and resume, failures relayed to every rank; ``sync_weights`` /
  ``probe_weights`` for one engine on rank 0.
- ``worker``: an engine's calls on its own thread, with the phase deadline.
- ``colocated_weights``: per-TP-rank payloads for an in-process engine that spans several GPUs.
- ``weight_probe``: the probe sequence, its tolerances and the verdict (fresh, stale or garbled weights).
"""
