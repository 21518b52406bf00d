"""Measure what the planner models: the bytes autograd keeps for backward, per micro-batch forward.

``SavedTensorMeter`` records, through ``torch.autograd.graph.saved_tensors_hooks``, every tensor saved for
backward while it is active, keyed by storage (a view and its base count once), parameters excluded. A new
phase starts at the first save after a backward has begun, so with a non-pipelined schedule (forward and
backward of one micro-batch, then the next) ``phases`` holds one total per micro-batch.
"""
from __future__ import annotations

from typing import Iterable

import torch


class SavedTensorMeter:
    """``with SavedTensorMeter(model.parameters()) as meter: train_step(...)``; then ``meter.phases``."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._phases: list[dict[int, int]] = []
        self._in_backward = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._in_backward:
            self._phases.append({})
            self._in_backward = False
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._exclude:
            self._phases[-1].setdefault(storage.data_ptr(), storage.nbytes())
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self._in_backward = True
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def phases(self) -> list[int]:
        """Bytes saved in each forward phase, in order."""
        return [sum(p.values()) for p in self._phases]
