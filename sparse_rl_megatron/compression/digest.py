"""A hash of every kept index set of one sequence, so two engines can show they kept the same tokens.

Byte format (engines must feed it identically): for each compression event in order, for each layer in
order, the kept *logical* token positions (position in prompt + response, 0-based) as a [Hkv, B] int64
little-endian C-contiguous array, preceded by the 8-byte little-endian header ``event_index * 2**16 + layer``.
The digest is the sha256 hex string; a sequence without events has digest ``None``.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

_LAYER_BITS = 16  # layers per event in the header; models have far fewer than 2**16 layers


class KeptDigest:
    """Incremental sha256 over (event, layer, kept positions)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.updates = 0

    def update(self, event: int, layer: int, positions: torch.Tensor) -> None:
        """Add one layer of one event. ``positions``: [Hkv, B] integer logical positions."""
        if positions.dim() != 2:
            raise ValueError(f"KeptDigest.update: positions must be [Hkv, B], got shape {tuple(positions.shape)}")
        header = (event << _LAYER_BITS) + layer
        self._hash.update(header.to_bytes(8, "little"))
        arr = positions.detach().to(device="cpu", dtype=torch.int64).contiguous().numpy()
        self._hash.update(arr.astype("<i8", copy=False).tobytes())
        self.updates += 1

    def update_layers(self, event: int, positions: torch.Tensor | Any) -> None:
        """Add every layer of one event at once (same bytes as calling :meth:`update` per layer in order).

        ``positions``: [L, Hkv, B] integer logical positions (a tensor, or an array already on the host, e.g.
        numpy's: read as it is, with no torch call, so the SGLang plugin's host-sync count stays exact).
        """
        if positions.ndim != 3:
            raise ValueError(f"KeptDigest.update_layers: positions must be [L, Hkv, B], got {tuple(positions.shape)}")
        if isinstance(positions, torch.Tensor):
            positions = positions.detach().to(device="cpu", dtype=torch.int64).numpy()
        data = positions.astype("<i8", copy=False)  # tobytes() below writes C order whatever the strides
        for layer in range(data.shape[0]):
            self._hash.update(((event << _LAYER_BITS) + layer).to_bytes(8, "little"))
            self._hash.update(data[layer].tobytes())
        self.updates += data.shape[0]

    def copy(self) -> "KeptDigest":
        """An independent digest with the same history (a GRPO group's samples share their prompt's events)."""
        new = KeptDigest()
        new._hash = self._hash.copy()
        new.updates = self.updates
        return new

    def hexdigest(self) -> str | None:
        return self._hash.hexdigest() if self.updates else None
