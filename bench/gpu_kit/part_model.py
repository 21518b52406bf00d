"""Part ``model``: the machine, the random HF checkpoint every later part loads, and a torch.compile probe.

The checkpoint is a randomly initialised Qwen2 (``sizes.model``) in bf16, built on the device and written to
the scratch folder (never under the results folder: 3 GB at the H200 size). bf16 weights load exactly into an
fp32 model too, so the fp32 and bf16 comparisons of ``logprobs`` share one set of weights.

The probe: megatron-core's fused SwiGLU and bias-dropout-add are ``torch.compile``d functions (its
``jit_fuser``), which on CUDA need Triton and a C compiler for Triton's launcher. The probe compiles one such
function here; if it fails, the learner parts turn those two fusions off (and say so) rather than fail.
"""
from __future__ import annotations

import importlib.metadata
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from gpu_kit.records import Recorder, gib, sync
from gpu_kit.sizes import Sizes

MODEL_DIR = "model"
INIT_STD = 0.02
"""Initializer range of the random weights (HF's default): near-uniform next-token distributions."""


def hf_config(sizes: Sizes):
    """The HF config of ``sizes.model`` (a bundled name or ``tiny_config`` keyword arguments)."""
    from transformers import AutoConfig

    from sparse_rl_megatron.models.catalog import bundled_config
    from sparse_rl_megatron.models.tiny import tiny_config

    if isinstance(sizes.model, str):
        cfg = bundled_config(sizes.model)
        cfg.pop("architectures", None)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    else:
        config = tiny_config("qwen2", **sizes.model)
    config.initializer_range = INIT_STD
    return config


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    info = dict(python=platform.python_version(), executable=sys.executable, platform=platform.platform(),
                cpus=__import__("os").cpu_count(), torch=torch.__version__, cuda=torch.version.cuda,
                cuda_available=torch.cuda.is_available(),
                **{d: _version(d) for d in ("transformers", "megatron-core", "triton", "numpy", "safetensors")},
                transformer_engine=_version("transformer-engine"), apex=_version("apex"),
                c_compiler=shutil.which("cc") or shutil.which("gcc"))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=gib(props.total_memory), gpu_count=torch.cuda.device_count(),
                    capability=f"{props.major}.{props.minor}")
    return info


def compile_probe() -> dict:
    """Compile and run a SwiGLU-like function with ``torch.compile`` on CUDA (what megatron's jit fuser does)."""
    import torch.nn.functional as F

    start = time.perf_counter()

    def swiglu(x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.compile(swiglu)(x)
    sync()
    err = (out.float() - swiglu(x).float()).abs().max().item()
    return dict(compiled_ok=True, max_abs_vs_eager=err, compile_s=round(time.perf_counter() - start, 2))


def run(rec: Recorder, sizes: Sizes, work: Path, device: torch.device) -> None:
    with rec.item("machine") as m:
        m.update(machine())
    if device.type == "cuda":
        with rec.item("torch.compile probe (megatron jit fusions)") as m:
            m.update(compile_probe())
    with rec.item("random HF checkpoint") as m:
        from transformers import AutoModelForCausalLM

        out = work / MODEL_DIR
        config = hf_config(sizes)
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except Exception as exc:  # noqa: BLE001 -- every later part needs this checkpoint: build it on the CPU
            m["built_on_cpu_because"] = f"{type(exc).__name__}: {exc}"[:300]
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        sync()
        m.update(init_s=round(time.perf_counter() - start, 2), built_on=str(next(model.parameters()).device))
        m["parameters_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 4)
        start = time.perf_counter()
        model.save_pretrained(out)
        m["save_s"] = round(time.perf_counter() - start, 2)
        m.update(path=str(out), layers=config.num_hidden_layers, hidden=config.hidden_size,
                 vocab=config.vocab_size, heads=f"{config.num_attention_heads}/{config.num_key_value_heads}",
                 size_gib=gib(sum(f.stat().st_size for f in out.glob("*.safetensors"))))
