"""Everything SGLang 0.5.x needs to run on a machine without CUDA, in one place.

Applied only when CUDA is absent (``apply()`` is a no-op otherwise):
- ``SGLANG_USE_CPU_ENGINE=1`` so SGLang takes its CPU code paths (rotary embedding, memory pools);
- ``TRITON_INTERPRET=1`` (unless set): Triton kernels run in Triton's interpreter on CPU tensors, so the GPU's
  ``triton`` attention backend and SGLang's index kernels run here (slowly; the interpreter test tier). Triton
  reads it when a kernel is defined, i.e. when SGLang is imported: call ``apply()`` before importing SGLang;
- the stand-in ``sgl_kernel`` package (``cpu_stubs/``) on ``sys.path`` and on ``PYTHONPATH`` so the
  scheduler processes SGLang spawns find it too.
The engine arguments a CPU engine needs (device, attention backend, ...) come from ``cpu_engine_kwargs()``.
The torchvision import fix is an install step (``launch/setup_env.sh``), not a runtime patch.

One runtime patch, installed by the plugin in every SGLang process when CUDA is absent (``register_hooks``):
SGLang pins the host buffers of its state capturers (``--enable-return-routed-experts``: the routed experts of
every token, R3) with ``cudaHostRegister``, which a CPU-only torch cannot call; on CPU they are plain memory
(``unpinned_host_alloc``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

STUB_DIR = Path(__file__).resolve().parent / "cpu_stubs"
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"
CPU_DEFAULT_POOL_TOKENS = 1 << 16
"""KV pool of a CPU engine or server when max_total_tokens is not given: SGLang would size it from a share of the
machine's RAM (``mem_fraction_static``, which a GPU recipe sets to 0.7: tens of GiB of KV zeroed at start-up on a
laptop); a ``mem_fraction_static`` that gives a smaller pool still wins (SGLang takes the smaller)."""
CPU_DEFAULT_RUNNING_REQUESTS = 256
"""Most requests a CPU engine or server decodes at once when max_running_requests is not given: SGLang would give
its request pool up to 4096 rows, and the plugin reserves its per-row memory (physical table, query rings) for all
of them at start-up (1.2 GiB, zeroed, for SmolLM2-135M's 30 layers); a CPU decodes far fewer at once."""


def cuda_available() -> bool:
    """This shim's own CUDA check (not ``sparse_rl_megatron.utils.device``): it runs before SGLang is imported, in
    server processes that need not load the trainer's package, and decides whether SGLang is patched at all."""
    import torch

    return torch.cuda.is_available()


def apply(force: bool = False) -> bool:
    """Make SGLang importable and runnable on CPU; returns True if the CPU compatibility was applied."""
    if cuda_available() and not force:
        return False
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ.setdefault(TRITON_INTERPRET_ENV, "1")
    stub = str(STUB_DIR)
    if stub not in sys.path:
        sys.path.insert(0, stub)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if stub not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([stub, *paths])
    return True


def runs_on_cpu(server_args) -> bool:
    """Whether a server with these (unresolved) arguments runs on CPU: ``device`` says so, or is not given on a
    machine without CUDA (SGLang then picks the CPU)."""
    device = server_args.device
    return device == "cpu" if device else not cuda_available()


def apply_cpu_server_defaults(server_args) -> None:
    """The CPU defaults of a ``sparse_kv`` server, set on its arguments before SGLang resolves them (the plugin's
    ``ServerArgs.resolve_once`` hook), so that a plain ``sglang.Engine(...)`` or ``sglang.launch_server`` gets them
    too, not only the project's engine and launcher: ``max_running_requests`` =
    ``CPU_DEFAULT_RUNNING_REQUESTS`` when not given (the plugin reserves its per-row memory for every row SGLang's
    request pool gets, up to 4097 of them otherwise)."""
    if runs_on_cpu(server_args) and server_args.max_running_requests is None:
        server_args.max_running_requests = CPU_DEFAULT_RUNNING_REQUESTS


def cpu_engine_kwargs() -> dict:
    """``sglang.Engine`` arguments that work on CPU: the torch-native attention and sampling (no CUDA kernels), no
    CUDA graphs, pages of one token (a page of several would mix kept and evicted tokens)."""
    return dict(
        device="cpu",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        page_size=1,
    )


def unpinned_host_alloc(original, dims, dtype, device, pin_memory, *args, **kwargs):
    """Around SGLang's ``alloc_with_host_register``: the same buffer, not pinned (nothing to pin for on CPU)."""
    return original(dims, dtype, device, False, *args, **kwargs)


def register_hooks() -> None:
    """In an SGLang process without CUDA: the host buffers of SGLang's state capturers unpinned. Called by the
    plugin's ``register``; a no-op with CUDA."""
    if cuda_available():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.mem_cache.pool_host.common.alloc_with_host_register", unpinned_host_alloc,
                          HookType.AROUND)
