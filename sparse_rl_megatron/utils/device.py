"""Device facts: what the package decides on about this machine's accelerator, resolved once and passed down.

``cuda_present()`` is the package's one answer to "is CUDA present". ``DeviceFacts.detect()`` reads it (and the
GPU count) once at a run's entry point: ``preflight`` (``sparse-rl train`` and ``sparse-rl mismatch``) keeps it
as ``RunPlan.device_facts``, ``sparse-rl preflight`` checks a launch with it, ``convert`` builds with it, and a
``Learner`` built without one detects it at its set-up. From there it is passed to where the decisions are made:

- the learner's ``auto`` parameter dtype and its distributed optimizer default (``learner/config.py``),
  DDP's ``overlap_grad_reduce`` (``learner/optimizer.py``), the layer spec and where the model lives
  (``learner/model_provider.py``), the fusions (``models/megatron_config.py``), the process-group backend
  (``learner/parallel.py``), the checkpoint's RNG states (``trainer/checkpointing/checkpoints.py``), the
  probe tolerance for ``auto`` (``trainer/engine_pool/weight_probe.py``), the rollout layout (``trainer/runtime``).

Functions that are also called on their own (tests, benches) take the facts as an optional argument and detect
them when it is not given, so the decisions are the same either way. Two framework-compatibility shims check
CUDA by themselves, on purpose: ``learner/cpu_compat.py`` patches megatron-core process-wide only where CUDA is
absent, and ``sglang_ext/cpu_compat.py`` does the same for SGLang before SGLang is imported (that package does
not depend on this one's helpers).
"""
from __future__ import annotations

from dataclasses import dataclass


def cuda_present() -> bool:
    """This process sees a CUDA device (``torch.cuda.is_available()``, read at each call; torch is imported here,
    not with this module, so the CLI's config checks stay free of it until a decision is made)."""
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class DeviceFacts:
    """The accelerator facts the code decides on (only those)."""

    cuda: bool
    """CUDA is present: the learner computes on GPUs (NCCL, bfloat16 by default, fusions, distributed optimizer)."""
    gpus: int
    """Visible CUDA devices (0 without CUDA)."""

    @classmethod
    def detect(cls) -> "DeviceFacts":
        """This machine's facts, read now."""
        import torch

        cuda = cuda_present()
        return cls(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0)

    @property
    def auto_params_dtype(self) -> str:
        """What ``params_dtype: auto`` stands for: bfloat16 with CUDA, float32 on CPU (megatron's CPU path trains
        float32 parameters only)."""
        return "bfloat16" if self.cuda else "float32"


def resolve(facts: DeviceFacts | None) -> DeviceFacts:
    """``facts``, or this machine's when None (for the functions that are also called on their own)."""
    return DeviceFacts.detect() if facts is None else facts
