"""The learner's sleep and wake: its device memory handed to the colocated rollout engines while they decode.

Every GPU recipe is colocated: a learner and an SGLang engine share each GPU and take turns. ``learner.offload``
names what of the learner sleeps (``OFFLOAD_MODES``), in three parts:

- ``weights``: the model's parameters and buffers (and the DDP buffer they are views of), a reference policy's too;
- ``gradients``: the fp32 main gradients (DDP's gradient buffer);
- ``optimizer``: Adam's moments and the fp32 main weights (the distributed optimizer's shards, or the whole copies).

The mechanism (the same on every device, so every path runs on this CPU): each device storage of a sleeping part
is copied to host memory (pinned with CUDA, reused from one sleep to the next) and resized to 0 bytes; waking
resizes it back and copies the bytes in. Tensors, their views (parameters into DDP's buffer, ``main_grad`` into
the gradient buffer, the optimizer's references) and the objects holding them stay the same: only the storages'
bytes move, as FSDP frees its flat parameters. Gradients are not copied: ``train_step`` zeroes them before every
step, so they wake as zeros. With CUDA the caching allocator then returns the freed blocks to the driver
(``empty_cache``), where the engine's scheduler process can take them.

Why not ``torch_memory_saver`` (what SGLang uses for its own pool): it frees only what was allocated inside its
region, which for the learner means building the model, DDP, the optimizer and Adam's lazily-created moments
inside it, and it needs its preloaded allocator hook in the trainer process; the storage swap needs neither and
runs (so is tested) on every device. What it does not keep is the device address of a buffer: nothing in the
learner captures one (no CUDA graphs, no registered NCCL user buffers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from sparse_rl_megatron.utils.registry import Registry

OFFLOAD_PARTS: tuple[str, ...] = ("weights", "gradients", "optimizer")
"""What of the learner can sleep, in the order a storage is attributed (a storage two parts reach counts once,
under the first)."""


@dataclass(frozen=True)
class OffloadMode:
    """One value of ``learner.offload``: the parts that sleep while the engines hold the GPU."""

    parts: frozenset[str]
    """A subset of ``OFFLOAD_PARTS``."""
    doc: str
    """One line for the docs and the errors."""


OFFLOAD_MODES: Registry[OffloadMode] = Registry("learner offload mode")
OFFLOAD_MODES.add("none", OffloadMode(frozenset(), "nothing sleeps: the learner keeps every tensor on its device"))
OFFLOAD_MODES.add("optimizer", OffloadMode(
    frozenset({"optimizer"}), "Adam's moments and the fp32 main weights sleep; the weights and gradients stay"))
OFFLOAD_MODES.add("all", OffloadMode(
    frozenset(OFFLOAD_PARTS), "weights, gradients and optimizer state sleep: no learner tensor stays on the device"))


def offload_parts(mode: str) -> frozenset[str]:
    """The parts ``mode`` puts to sleep (``UnknownNameError`` naming the valid modes)."""
    return OFFLOAD_MODES.get(mode).parts


def _torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron-core optimizer (a ``ChainedOptimizer`` holds one per parameter
    kind, e.g. dense and expert parameters)."""
    from megatron.core.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        for inner in optimizer.chained_optimizers:
            yield from _torch_optimizers(inner)
    else:
        yield optimizer.optimizer


def part_tensors(model, ddp, optimizer) -> dict[str, list[torch.Tensor]]:
    """Every tensor of each part: ``model`` the stage model, ``ddp`` megatron's DDP around it (None: not trainable),
    ``optimizer`` megatron's optimizer (None likewise). The lists may reach a storage more than once."""
    weights = [*model.parameters(), *model.buffers()]
    gradients: list[torch.Tensor] = []
    optim: list[torch.Tensor] = []
    if ddp is not None:
        for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]:
            if buffer.param_data is not None:
                weights.append(buffer.param_data)
            gradients.append(buffer.grad_data)
    for p in model.parameters():
        for grad in (getattr(p, "main_grad", None), p.grad):  # main_grad: megatron's attribute, absent before DDP
            if grad is not None:
                gradients.append(grad)
    if optimizer is not None:
        for opt in _torch_optimizers(optimizer):
            for group in opt.param_groups:
                optim.extend(group["params"])  # fp32 main weights (the model's own parameters in FP32Optimizer)
            for state in opt.state.values():
                optim.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return {"weights": weights, "gradients": gradients, "optimizer": optim}


def part_storages(tensors: dict[str, list[torch.Tensor]],
                  device: torch.device | None = None) -> dict[str, list[torch.UntypedStorage]]:
    """Each part's distinct non-empty storages on ``device``'s type (None: any; a GPU learner's host-side scalars,
    such as Adam's step counts, are not device memory); one reached by several parts belongs to the first in
    ``OFFLOAD_PARTS`` (FP32Optimizer's main weights are the model's parameters: weights)."""
    seen: set[int] = set()
    out: dict[str, list[torch.UntypedStorage]] = {}
    for part in OFFLOAD_PARTS:
        out[part] = []
        for t in tensors.get(part, ()):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if (device is not None and storage.device.type != device.type) or storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            out[part].append(storage)
    return out


def storage_bytes(storages: Iterable[torch.UntypedStorage]) -> int:
    return sum(s.nbytes() for s in storages)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (to copy it with tensor ops)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Sleeper:
    """Puts parts of one learner to sleep and wakes them, within what its offload mode allows.

    ``sleep(collect, device, parts)`` calls ``collect()`` for ``part_tensors(...)`` as they are at that moment (Adam
    creates its moments at the first step, so they are collected at each sleep that moves anything) and moves the storages of ``parts`` (None: every part
    of the mode) that are awake; ``wake(parts)`` restores exactly the storages those parts put to sleep. So the
    weights can be awake for a recompute or a weight push while the gradients and the optimizer state sleep."""

    def __init__(self, mode: str):
        self.mode = mode
        self.parts = offload_parts(mode)
        self._asleep: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}  # part -> (storage, bytes it had)
        self._host: dict[int, torch.Tensor] = {}  # storage impl -> host copy, reused across sleeps
        self.host_bytes = 0
        """Bytes of host memory holding sleeping parts (gradients are not copied)."""

    @property
    def asleep_parts(self) -> frozenset[str]:
        return frozenset(self._asleep)

    @property
    def asleep(self) -> bool:
        return bool(self._asleep)

    def sleep(self, collect: Callable[[], dict[str, list[torch.Tensor]]], device: torch.device,
              parts: Iterable[str] | None = None) -> dict[str, int]:
        """Move every storage of ``parts`` (of the mode's; None: all of them) that is awake off ``device``. Returns
        the bytes freed per part."""
        todo = [p for p in OFFLOAD_PARTS if p in (self.parts if parts is None else set(parts) & self.parts)
                and p not in self._asleep]
        freed = dict.fromkeys(OFFLOAD_PARTS, 0)
        if not todo:
            return freed
        storages = part_storages(collect(), device)  # an asleep part's storages are empty: not reached again
        cuda = device.type == "cuda"
        moved: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        for part in todo:
            moved[part] = []
            for storage in storages[part]:
                if storage.device.type == "cpu" and storage.is_shared():
                    raise RuntimeError(
                        f"learner.offload={self.mode}: a {part} storage of {storage.nbytes()} bytes is in shared memory "
                        "(a CPU tensor pickled to another process moves there in place), where it cannot be resized "
                        "back after a sleep; hand other processes copies of the learner's tensors")
                nbytes = storage.nbytes()
                if part != "gradients":  # zeroed before every step: nothing to keep
                    self._host_copy(storage, nbytes).copy_(_as_bytes(storage), non_blocking=cuda)
                moved[part].append((storage, nbytes))
                freed[part] += nbytes
        if cuda:
            torch.cuda.synchronize()  # the copies are done before the storages go
        for part, entries in moved.items():
            for storage, _ in entries:
                storage.resize_(0)
            self._asleep[part] = entries
        if cuda:
            torch.cuda.empty_cache()  # back to the driver: the engine's scheduler is another process
        return freed

    def wake(self, parts: Iterable[str] | None = None) -> None:
        """Give the sleeping storages of ``parts`` (None: every sleeping part) their bytes back (gradients as zeros)."""
        todo = [p for p in OFFLOAD_PARTS if p in self._asleep and (parts is None or p in set(parts))]
        cuda = False
        for part in todo:
            for storage, nbytes in self._asleep.pop(part):
                storage.resize_(nbytes)
                view = _as_bytes(storage)
                on_cuda = storage.device.type == "cuda"
                cuda = cuda or on_cuda
                if part == "gradients":
                    view.zero_()
                else:
                    view.copy_(self._host[_key(storage)], non_blocking=on_cuda)
        if cuda:
            torch.cuda.synchronize()

    def _host_copy(self, storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
        key = _key(storage)
        host = self._host.get(key)
        if host is None or host.numel() != nbytes:
            if host is not None:
                self.host_bytes -= host.numel()
            host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=storage.device.type == "cuda")
            self._host[key] = host
            self.host_bytes += nbytes
        return host


def _key(storage: torch.UntypedStorage) -> int:
    """The identity of a storage's implementation: stable across ``untyped_storage()`` handles and resizes
    (its data pointer is not: a resize moves it)."""
    return storage._cdata
