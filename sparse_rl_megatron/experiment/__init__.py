"""``sparse-rl experiment``: the paper's three claims at small scale, as arms of ``sparse-rl train`` runs.

Arms (``arms.py``) are config overrides of one base recipe: dense rollouts, naive sparse rollouts (correction
off), Sparse-RL (R-KV, SnapKV), and an equal-time supervised control. All arms of a seed start from one warm
start; each arm is its own run directory (``runner.py``); ``results.py`` tabulates, ``figure.py`` draws.
"""
