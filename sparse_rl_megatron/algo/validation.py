"""Input checks shared by the algorithm functions: shapes, masks, finite log-probs.

Every public function of ``algo`` validates what it is given, so bad data fails loudly with the name of
the argument (and, for non-finite values, the first bad position) instead of turning into a silent NaN
loss several steps later. Padding positions (mask False) may hold anything, NaN included: they are never
read, because every computation selects them away with ``torch.where`` before any arithmetic.
"""
from __future__ import annotations

import torch


def as_bool_mask(mask: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Return ``mask`` as a bool tensor; accepts bool or 0/1 integer/float tensors.

    Raises ``TypeError`` for a non-tensor and ``ValueError`` for values other than 0 and 1.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (bool or 0/1), got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or a 0/1 real tensor, got dtype {mask.dtype}")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        raise ValueError(f"{name} must hold only 0/1 (or bool) values; found e.g. {mask[bad][0].item()}")
    return mask != 0


def check_2d(tensor: torch.Tensor, name: str) -> None:
    """Require a ``[B, T]`` tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, T], got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"{name} must have shape [B, T] (2 dims), got shape {tuple(tensor.shape)}")


def check_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Require every tensor in ``others`` (None skipped) to have the shape of ``reference``."""
    for name, tensor in others.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != reference.shape:
            raise ValueError(
                f"shape mismatch: {name} has shape {tuple(tensor.shape)} but {reference_name} has "
                f"shape {tuple(reference.shape)}"
            )


def check_per_sample(tensor: torch.Tensor, name: str, batch_size: int) -> None:
    """Require a ``[B]`` tensor with ``B == batch_size``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B], got {type(tensor).__name__}")
    if tensor.shape != (batch_size,):
        raise ValueError(f"{name} must have shape [B] = ({batch_size},), got shape {tuple(tensor.shape)}")


def check_finite_where(values: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` if ``values`` is NaN or +-inf at any position where ``mask`` is True.

    Costs one device->host sync; the algorithm calls it once per rollout (and once per micro-batch for
    the current log-probs unless ``LossConfig.check_finite`` is off).
    """
    bad = mask & ~torch.isfinite(values)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) at response positions, first at index {idx} "
            f"(value {values[idx].item()}); log-probs must be finite wherever the mask is set"
        )
