"""Memory planning before renting GPUs (``sparse-rl plan``): per-GPU learner memory at a TP x PP x DP layout and
the rollout KV budget, dense vs compressed. Formulas: ``docs/memory-planning.md``.

Light to import (no megatron-core, no transformers); torch is needed only for the compression schedule.
"""
