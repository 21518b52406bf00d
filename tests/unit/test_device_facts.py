"""Device facts are read once and passed down: the decisions follow the ``DeviceFacts`` they are given (not the
machine they run on), the defaults read this machine's, and no module but ``utils/device.py`` and the two CPU
compatibility shims asks torch about CUDA itself."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import sglang_ext
import sparse_rl_megatron
from sparse_rl_megatron.learner.config import LearnerConfig, OptimConfig
from sparse_rl_megatron.learner.model_provider import resolve_layer_spec
from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.trainer.engine_pool.weight_probe import PROBE_TOLERANCE_16BIT, PROBE_TOLERANCE_FP32, probe_tolerance
from sparse_rl_megatron.utils.device import DeviceFacts, cuda_present

GPU = DeviceFacts(cuda=True, gpus=8)
CPU = DeviceFacts(cuda=False, gpus=0)
SHIMS = {"sparse_rl_megatron/utils/device.py", "sparse_rl_megatron/learner/cpu_compat.py", "sglang_ext/cpu_compat.py"}
"""The one CUDA check, and the shims that patch a framework process-wide where CUDA is absent (they say why)."""


def _asks_torch_for_cuda(path: Path) -> list[int]:
    """Lines of ``path`` that call ``<x>.cuda.is_available()`` or ``<x>.cuda.device_count()``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("is_available", "device_count")
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "cuda"):
            lines.append(node.lineno)
    return lines


def test_only_the_device_module_and_the_shims_ask_torch_about_cuda():
    root = Path(sparse_rl_megatron.__file__).parent.parent
    found = {}
    for package in (sparse_rl_megatron, sglang_ext):
        for path in sorted(Path(package.__file__).parent.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            lines = _asks_torch_for_cuda(path)
            if lines and rel not in SHIMS:
                found[rel] = lines
    assert not found, f"decide on DeviceFacts / cuda_present() (utils/device.py) instead: {found}"


def test_this_machine_is_detected_as_torch_sees_it():
    facts = DeviceFacts.detect()
    assert facts.cuda == cuda_present() == torch.cuda.is_available()
    assert facts.gpus == (torch.cuda.device_count() if facts.cuda else 0)
    assert facts.auto_params_dtype == ("bfloat16" if facts.cuda else "float32")


def test_learner_dtype_and_distributed_optimizer_follow_the_facts_given():
    cfg = LearnerConfig(model_path="m")
    assert (cfg.torch_params_dtype(GPU), cfg.distributed_optimizer(GPU)) == (torch.bfloat16, True)
    assert (cfg.torch_params_dtype(CPU), cfg.distributed_optimizer(CPU)) == (torch.float32, False)
    assert cfg.torch_params_dtype() == cfg.torch_params_dtype(DeviceFacts.detect())  # default: this machine
    stated = LearnerConfig(model_path="m", params_dtype="float32", optim=OptimConfig(use_distributed_optimizer=False))
    assert (stated.torch_params_dtype(GPU), stated.distributed_optimizer(GPU)) == (torch.float32, False)


def test_layer_spec_without_cuda_is_local_and_te_is_refused_naming_it():
    assert resolve_layer_spec("auto", CPU) == "local" and resolve_layer_spec("local", GPU) == "local"
    with pytest.raises(RuntimeError, match=r"layer_spec='te' needs Transformer Engine and a CUDA device \(no CUDA"):
        resolve_layer_spec("te", CPU)


def test_probe_tolerance_of_an_auto_learner_follows_the_facts_given():
    cfg = TrainConfig()
    assert cfg.learner.params_dtype == "auto" and cfg.rollout.dtype == "float32"
    assert probe_tolerance(cfg, device_facts=GPU) == PROBE_TOLERANCE_16BIT
    assert probe_tolerance(cfg, device_facts=CPU) == PROBE_TOLERANCE_FP32
