"""megatron-core on a CPU-only torch: the workarounds W1-W13, in one place.

megatron-core 0.16.1 (and 0.17-0.19) hard-codes CUDA in many spots that a CPU run with the gloo backend
walks through. Each patch below is numbered in the order an investigation of megatron-core on CPU found the spot
(W1-W13, each described below), does the least that makes the spot run on CPU,
and is applied only when ``torch.cuda.is_available()`` is False. ``apply()`` is idempotent. This shim checks CUDA
by itself, on purpose, instead of taking the run's ``utils.device.DeviceFacts``: it patches megatron-core
process-wide, from whichever entry point reaches megatron first, and must answer for this torch build itself.

- W1 ``torch.cuda.current_device()`` -> ``"cpu"`` (rope ``inv_freq``, TP buffers, p2p shapes, DDP buffers).
- W2 the model-parallel RNG tracker keeps CPU generator states instead of CUDA ones.
- W3 the default causal mask is built on CPU (cached per length, like the original).
- W4 ``torch.cuda.synchronize()`` is a no-op (called after p2p batches).
- W5 a ``TorchFunctionMode`` rewrites ``device="cuda..."`` keyword arguments to ``"cpu"``
  (schedules' token counters, grad-norm buffers, the grad scaler, ...) and makes ``Tensor.cuda()`` return
  the tensor itself (tied embeddings at PP > 1: ``weight.data = weight.data.cuda()`` before the first/last
  stage all-reduce; not in the investigation, found by the tied-embedding PP = 2 test). It is SCOPED:
  active only inside ``device_mode()`` / functions decorated with ``in_device_mode`` (the learner's entry
  points into megatron-core), because a mode costs one Python call per torch call for everything else in
  the process (the HF rollout engine decoded 1.9x slower under a global mode in the single-process smoke run).
- W6 ``clip_grad_by_total_norm_fp32`` without its ``torch.cuda.FloatTensor`` assertion.
- W7 (opt-in, scoped) ``Tensor.type()`` reports ``torch.cuda.*`` names, only inside
  ``pretend_cuda_tensor_types()``, for the DistributedOptimizer's dtype checks at construction.
- W8 ``torch.cuda.current_stream()`` returns a stream whose waits are no-ops (DDP grad sync in 0.17+).
- W9 activation recompute (``recompute_granularity="full"``, megatron's ``CheckpointFunction``) saves and
  restores "the CUDA RNG state" through ``tensor_parallel.random._get/_set_cuda_rng_state``: on CPU that
  state is the CPU generator's (as in W2), so the recomputed forward draws the same numbers.
- W10 megatron-core's fusion functions are decorated at import with ``torch.compile`` (``megatron.core.jit``'s
  ``jit_fuser``), which imports torch's inductor, ~1 CPU s in every process that imports megatron-core, though the
  learner's models on CPU call none of them (every fusion off, ``models.megatron_config.fusion_settings``; SwiGLU,
  no MoE). While ``apply()`` imports megatron-core, ``torch.compile`` returns a wrapper that compiles on the first
  call instead (the same compile, later; plain functions and methods alike). ``torch.compile`` itself is restored
  right after, but ``megatron.core.jit.jit_fuser`` keeps the deferring one for the life of the process, so
  megatron modules imported later defer too. No effect if megatron-core was imported before ``apply()``.
- W11 the MoE router's gating (``moe_utils.router_gating_linear``) tests ``te_general_gemm is not None``, a name
  megatron-core binds only when Transformer Engine imports: without TE it raises NameError. Bound to None, the
  router computes its logits with torch's matmul.
- W12 the ``alltoall`` token dispatcher of mixtures of experts (the learner's, for expert parallelism) creates a
  ``torch.cuda.Stream`` for its device-to-host copies of the split sizes when it is built, records an event on
  it and waits for that event, and hands ``torch.distributed.all_to_all_single`` the split sizes as numpy
  arrays only when they came from a GPU (``maybe_move_tensor_to_cpu(..., as_numpy=True)`` leaves a CPU tensor a
  tensor, which the collective refuses). On CPU its stream is a ``_NullStream`` whose events are no-ops and CPU
  split sizes become numpy arrays as on GPU; gloo runs the all-to-all itself.
- W13 the MoE router calls one ``jit_fuser`` (``torch.compile``) function on every forward,
  ``TopKRouter._apply_expert_bias`` (a no-op unless ``moe_router_enable_expert_bias``): under W10 its first call
  would import torch's inductor and compile C++ on the CPU. It runs eagerly instead (the same function).

On a CUDA machine none of this is applied; the GPU code paths are megatron-core's own.
The W5 mode lives on the mode stack of the thread that enters ``device_mode()`` (torch keeps one per thread).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_APPLIED: list[str] = []  # names of the patches in effect since apply(), in order; non-empty once applied
_ARMED: list[str] = []  # names of the scoped patches apply() made ready, in effect only inside their blocks
SCOPED = {"W5": "device_mode()", "W7": "pretend_cuda_tensor_types()"}
"""The patches ``apply()`` only arms: each is in effect inside its block, on the thread that enters it."""
_PRETEND_CUDA_TYPES = False  # W7 switch, flipped only by pretend_cuda_tensor_types()
_MODE_DEPTH = threading.local()  # per-thread nesting depth of device_mode()


def is_applied() -> bool:
    """True once ``apply()`` patched this process."""
    return bool(_APPLIED)


def applied_patches() -> list[str]:
    """The names (``"W1"`` ...) of the patches in effect in this process since ``apply()``: not the scoped W5 and W7
    (``armed_patches``), and W10 only when ``apply()``'s import of megatron-core was its first (it defers the
    compiles of that import)."""
    return list(_APPLIED)


def armed_patches() -> list[str]:
    """The scoped patches ``apply()`` made ready (``SCOPED``: W5, W7), each in effect only inside its block."""
    return list(_ARMED)


def active_patches() -> list[str]:
    """The patches in effect on this thread now: the applied ones, plus W5 inside ``device_mode()`` and W7 inside
    ``pretend_cuda_tensor_types()`` within it (W7 answers only under W5's mode)."""
    scoped = []
    if getattr(_MODE_DEPTH, "value", 0):
        scoped.append("W5")
        if _PRETEND_CUDA_TYPES:
            scoped.append("W7")
    return sorted(_APPLIED + scoped, key=lambda name: int(name[1:]))


# ---------------------------------------------------------------- W2: RNG tracker on CPU generators
def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """``CudaRNGStatesTracker`` whose named states are CPU generator states.

        ``fork(name)`` swaps the named state into the global CPU generator and back, so dropout
        inside tensor-parallel regions draws from per-TP-rank streams as on GPU.
        """

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CPURNGStatesTracker


# ---------------------------------------------------------------- W3: causal mask on CPU
@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """[sq, sq] bool, True above the diagonal (= masked), like megatron's CUDA version."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


# ---------------------------------------------------------------- W5 (+W7): cuda device kwargs -> cpu
class CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device="cuda"``/``device="cuda:N"``/``torch.device("cuda")`` keyword args to CPU, and
    ``t.cuda()`` to ``t``.

    With W7 switched on (``pretend_cuda_tensor_types``), ``Tensor.type()`` with no argument answers
    ``torch.cuda.FloatTensor`` etc., which the DistributedOptimizer checks parameters against.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs = dict(kwargs, device="cpu")
        out = func(*args, **kwargs)
        if _PRETEND_CUDA_TYPES and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            if isinstance(out, str) and out.startswith("torch.") and not out.startswith("torch.cuda."):
                out = out.replace("torch.", "torch.cuda.", 1)
        return out


@contextlib.contextmanager
def device_mode() -> Iterator[None]:
    """W5, scoped: inside this block ``device="cuda"`` keyword arguments land on the CPU and ``t.cuda()`` is
    ``t``. Re-entrant (nested blocks push the mode once); a no-op unless ``apply()`` patched this process."""
    if not is_applied():
        yield
        return
    depth = getattr(_MODE_DEPTH, "value", 0)
    _MODE_DEPTH.value = depth + 1
    try:
        if depth:
            yield
        else:
            with CudaToCpuMode():
                yield
    finally:
        _MODE_DEPTH.value = depth


def in_device_mode(fn):
    """Decorator: run ``fn`` inside ``device_mode()`` (for entry points that drive megatron-core)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with device_mode():
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def pretend_cuda_tensor_types() -> Iterator[None]:
    """W7: inside this block (CPU only, and inside ``device_mode()``) ``t.type()`` reads ``torch.cuda.<T>Tensor``.

    Only for the DistributedOptimizer's construction-time dtype checks on CPU; a no-op on GPU.
    """
    global _PRETEND_CUDA_TYPES
    if not is_applied():
        yield
        return
    previous, _PRETEND_CUDA_TYPES = _PRETEND_CUDA_TYPES, True
    try:
        yield
    finally:
        _PRETEND_CUDA_TYPES = previous


# ---------------------------------------------------------------- W10: import-time torch.compile deferred
class CompileOnFirstCall:
    """``compile_fn(fn, **options)`` (``torch.compile``) done on the first call of the wrapper, not at decoration."""

    def __init__(self, compile_fn, fn, options: dict[str, Any]):
        functools.update_wrapper(self, fn)
        self._compile_fn, self._fn, self._options = compile_fn, fn, options
        self._compiled = None

    @property
    def compiled(self) -> bool:
        """True once the first call compiled ``fn``."""
        return self._compiled is not None

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            self._compiled = self._compile_fn(self._fn, **self._options)
        return self._compiled(*args, **kwargs)

    def __get__(self, obj, objtype=None):
        """On an instance, bound like the function it wraps (megatron decorates methods too: ``L2Norm._norm``)."""
        return self if obj is None else types.MethodType(self, obj)

    def __reduce__(self):
        """Pickled by reference, as the function it wraps (e.g. a ``TransformerConfig.activation_func``)."""
        return _module_attribute, (self._fn.__module__, self._fn.__qualname__)


def _module_attribute(module: str, qualname: str) -> Any:
    """``module.qualname`` (dotted), imported."""
    import importlib

    value: Any = importlib.import_module(module)
    for name in qualname.split("."):
        value = getattr(value, name)
    return value


@contextlib.contextmanager
def compile_on_first_call() -> Iterator[None]:
    """W10: inside this block ``torch.compile(fn, ...)`` and ``@torch.compile(...)`` on a function return a
    ``CompileOnFirstCall``; modules are compiled as usual. ``torch.compile`` is restored on exit."""
    real = torch.compile

    def deferred(model=None, **options):
        if model is None:
            return lambda fn: deferred(fn, **options)
        if isinstance(model, torch.nn.Module):
            return real(model, **options)
        return CompileOnFirstCall(real, model, options)

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


# ---------------------------------------------------------------- W6: grad clipping without CUDA assert
def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Same contract as megatron's ``clip_grad_by_total_norm_fp32`` (grads scaled in place when the
    clip coefficient ``max_norm / (total_norm + 1e-6)`` is below 1), without the CUDA type check."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    for g in grads:
        if g.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"grad clipping expects fp32/bf16 grads, got {g.dtype}")
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


# ---------------------------------------------------------------- W8: stream stubs
class _NullStream:
    """Stands in for ``torch.cuda.Stream`` where megatron only orders work between streams."""

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, *args: Any, **kwargs: Any) -> "_NullEvent":
        return _NullEvent()


class _NullEvent:
    """Stands in for ``torch.cuda.Event`` where megatron waits for work on a ``_NullStream`` (W12)."""

    def synchronize(self) -> None:
        return None

    def wait(self, *args: Any, **kwargs: Any) -> None:
        return None


# ---------------------------------------------------------------- W12: the alltoall dispatcher's split sizes on CPU
def _split_sizes_on_host(move):
    """megatron's ``maybe_move_tensor_to_cpu`` that also turns a CPU tensor into numpy when ``as_numpy`` (W12)."""

    @functools.wraps(move)
    def wrapper(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return wrapper


# ---------------------------------------------------------------- W9: recompute's RNG state on CPU
def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Stands in for megatron's ``_get_cuda_rng_state``: the CPU generator's state (a fresh tensor)."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Stands in for megatron's ``_set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def apply(force: bool = False) -> bool:
    """Apply W1-W13 if this torch has no CUDA (or ``force``). Returns True if the patches are active.

    Call before building megatron-core models. Safe to call many times.
    """
    if torch.cuda.is_available() and not force:
        return False
    with _LOCK:
        if _APPLIED:
            return True
        from sparse_rl_megatron.utils.quiet import silence_expected_cpu_warnings

        silence_expected_cpu_warnings()  # before megatron-core's first import, which raises most of them
        first_import = "megatron.core" not in sys.modules
        with compile_on_first_call():  # W10
            from megatron.core.fusions import fused_softmax
            from megatron.core.optimizer import clip_grads, optimizer as moptimizer
            from megatron.core.tensor_parallel import random as mrandom
            from megatron.core.transformer import utils as tutils
            from megatron.core.transformer.moe import moe_utils, router as mrouter, token_dispatcher

        torch.cuda.current_device = lambda: "cpu"  # W1
        _APPLIED.append("W1")

        mrandom.CudaRNGStatesTracker = _cpu_rng_tracker_class()  # W2
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        torch.cuda.manual_seed = lambda seed: None  # the default stream is the CPU generator's
        _APPLIED.append("W2")

        tutils.get_default_causal_mask = _cpu_default_causal_mask  # W3
        fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
        _APPLIED.append("W3")

        torch.cuda.synchronize = lambda *a, **k: None  # W4
        _APPLIED.append("W4")

        _ARMED.append("W5")  # scoped: entered by device_mode() (W7 piggybacks on it)

        clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu  # W6
        moptimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
        _APPLIED.append("W6")
        _ARMED.append("W7")  # scoped: entered by pretend_cuda_tensor_types()

        torch.cuda.current_stream = lambda *a, **k: _NullStream()  # W8
        _APPLIED.append("W8")

        mrandom._get_cuda_rng_state = _cpu_get_rng_state  # W9
        mrandom._set_cuda_rng_state = _cpu_set_rng_state
        _APPLIED.append("W9")
        if first_import:  # W10 took effect above only if this import of megatron-core was its first
            _APPLIED.append("W10")

        if "te_general_gemm" not in vars(moe_utils):  # W11 (TE binds it when it imports)
            moe_utils.te_general_gemm = None
        _APPLIED.append("W11")

        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NullStream()  # W12
        token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_on_host(token_dispatcher.maybe_move_tensor_to_cpu)
        _APPLIED.append("W12")

        expert_bias = mrouter.TopKRouter.__dict__["_apply_expert_bias"]  # W13
        if isinstance(expert_bias, CompileOnFirstCall):
            mrouter.TopKRouter._apply_expert_bias = expert_bias._fn
        _APPLIED.append("W13")
    return True
