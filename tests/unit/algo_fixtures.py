"""Hand-worked rollout batch shared by the algo tests (helper module, not a test file).

Three samples of one GRPO group, T = 3, all old log-probs -1:
  sample 0 (reward 1): rho = [1.2, 2.0, 1.0]   -> token 1 rejected (rho > 1.5)
  sample 1 (reward 0): rho = [0.6, 1.0, pad]    -> kept
  sample 2 (reward 1): rho = [1.0, 5e-5, 1.0]   -> vetoed (rho < 1e-4)
Kept weights (truncate at 1.5): [1.2, _, 1.0], [0.6, 1.0]: sum 3.8 over 4 tokens -> factor 4 / 3.8.
GRPO over the kept samples {0, 1}, rewards [1, 0]: A = +-0.5 / (sqrt(0.5) + 1e-6).
"""
import math

import torch

D = torch.float64
RHO = [[1.2, 2.0, 1.0], [0.6, 1.0, 1.0], [1.0, 5e-5, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
REWARDS = torch.tensor([1.0, 0.0, 1.0], dtype=D)
GROUPS = torch.tensor([0, 0, 0])
FACTOR = 4 / 3.8
ADV = 0.5 / (math.sqrt(0.5) + 1e-6)


def batch():
    old = torch.full((3, 3), -1.0, dtype=D)
    log_rho = torch.tensor([[math.log(r) for r in row] for row in RHO], dtype=D)
    sampler = old - log_rho
    sampler[1, 2] = float("nan")  # padding garbage must be harmless
    return old, sampler, MASK.clone(), REWARDS.clone(), GROUPS.clone()
