"""Models built for unit tests (helper module, not a test file)."""
from __future__ import annotations

from pathlib import Path

import torch


def cache_sensitive_modchain_model(out: Path) -> Path:
    """A modchain-shaped model in ``out`` with large random weights (its greedy responses depend on the cache)."""
    from transformers import AutoModelForCausalLM

    from sparse_rl_megatron.tasks import get_task

    out = get_task("task:modchain").build_model(out, seed=0)
    model = AutoModelForCausalLM.from_pretrained(out)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(out)
    return out
