"""Host syncs in the plugin's hooks: how host data reaches the device without one, and a counter to prove it.

On a GPU every device-to-host read (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ...), every blocking
host-to-device copy (``torch.tensor(list, device=cuda)``, a numpy index) and every op whose output size depends on
device data (``nonzero``, boolean-mask indexing, ``unique``) makes the host wait for the device: the overlap
scheduler's lead is lost. The plugin keeps its decisions on the host (numpy, ``row_state``) and follows two rules:

- host data goes to the device only through :func:`to_device` (pinned memory, ``non_blocking``: no sync);
- device data comes back only through :func:`to_host` (one counted sync), and only where a number is needed.

The counter (:class:`HostSyncCounter`, a ``TorchFunctionMode``) counts what would sync on a GPU, on any device:
inside the plugin's hooks (:func:`counted`) a torch tensor is a device tensor and host data is numpy or Python.
It is off unless a counter is installed (:func:`install`): tests and ``stats_path`` runs with
``count_host_syncs``. The inner attention backend's own calls are not the plugin's and are not counted
(:func:`not_counted`).
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

_D2H = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere", "repeat_interleave"}
_FROM_HOST = {"tensor", "as_tensor", "new_tensor"}
_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}


def _is_host_data(x: Any) -> bool:
    return isinstance(x, (np.ndarray, list, tuple)) and not (isinstance(x, tuple) and
                                                              all(isinstance(i, (int, slice, type(None))) for i in x))


def _index_parts(index: Any) -> list:
    return list(index) if isinstance(index, tuple) else [index]


class HostSyncCounter(TorchFunctionMode):
    """Counts, by kind, the torch calls that would make the host wait for a GPU (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.staged = 0
        """Host-to-device copies through :func:`to_device` (asynchronous on a GPU: not syncs)."""
        self.enabled = True
        self.depth = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.enabled:
            kind = self._kind(func, args, kwargs)
            if kind is not None:
                self.counts[kind] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _kind(func, args, kwargs) -> str | None:
        name = getattr(func, "__name__", "")
        if name in _D2H:
            return "device->host"
        if name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device"))):
            return "device->host"
        if name in _DATA_DEPENDENT or (name == "where" and len(args) + len(kwargs) == 1):
            return "data-dependent shape"
        if name in _FROM_HOST:
            data = args[1] if name == "new_tensor" else (args[0] if args else kwargs.get("data"))
            return None if isinstance(data, torch.Tensor) else "host->device"
        if name in _INDEXING and len(args) >= 2:
            parts = _index_parts(args[1])
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                return "data-dependent shape"
            if any(_is_host_data(p) for p in parts) or (len(args) > 2 and _is_host_data(args[2])):
                return "host->device"
        return None


_COUNTER: HostSyncCounter | None = None


@contextlib.contextmanager
def install(counter: HostSyncCounter | None = None):
    """Count the plugin's host syncs while the block runs (``counter`` accumulates; a new one by default)."""
    global _COUNTER
    previous, _COUNTER = _COUNTER, counter if counter is not None else HostSyncCounter()
    try:
        yield _COUNTER
    finally:
        _COUNTER = previous


def install_for_process(counter: HostSyncCounter) -> None:
    """Count from now on, in this process (a server with ``count_host_syncs``)."""
    global _COUNTER
    _COUNTER = counter


def active() -> HostSyncCounter | None:
    return _COUNTER


def counted(fn: Callable) -> Callable:
    """Decorate a plugin hook: with a counter installed, its torch calls are counted (nested hooks once)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        counter = _COUNTER
        if counter is None or counter.depth:
            return fn(*args, **kwargs)
        counter.depth += 1
        try:
            with counter:
                return fn(*args, **kwargs)
        finally:
            counter.depth -= 1
    return wrapper


@contextlib.contextmanager
def not_counted():
    """Calls that are not the plugin's own (the inner attention backend's metadata and kernels)."""
    counter = _COUNTER
    if counter is None or not counter.enabled:
        yield
        return
    counter.enabled = False
    try:
        yield
    finally:
        counter.enabled = True


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """Host data (numpy) on the device without a sync: a pinned copy sent ``non_blocking`` (CUDA); a copy (CPU)."""
    counter = _COUNTER
    if counter is not None:
        counter.staged += 1
    with not_counted():
        host = torch.from_numpy(np.ascontiguousarray(array))
        if torch.device(device).type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)
        return host.clone()


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """Device data on the host: one sync (counted). The only way plugin hooks read device values."""
    host = tensor.detach().cpu()
    with not_counted():
        return host.numpy()
