"""Fixtures of the SGLang tier: one tiny GQA model on disk and its HF twin (helpers in ``sglang_helpers.py``).

Engines are expensive on CPU (~25 s CPU to start), so every test module starts at most one and shares it.
The strict memory checkers are switched on for every engine these tests start: SGLang then raises on any
leaked or double-freed KV slot, when idle and after every scheduler step.

``cpu_compat.apply()`` runs here, before any test of the tier imports SGLang: on a machine without CUDA it
sets TRITON_INTERPRET=1, which Triton reads when SGLang's kernels are defined (the interpreter tests).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from sglang_helpers import INIT_STD, MODEL_SEED

from sglang_ext import cpu_compat

cpu_compat.apply()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

    return save_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), seed=MODEL_SEED, init_std=INIT_STD)


@pytest.fixture(scope="session")
def hf_model():
    from sparse_rl_megatron.models.tiny import build_tiny_model

    return build_tiny_model(seed=MODEL_SEED, init_std=INIT_STD)
