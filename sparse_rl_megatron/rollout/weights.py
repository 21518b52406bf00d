"""Loading HF-named weights into a live HF model (weight sync from the trainer, or an HF directory)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

_MAX_LISTED = 8  # names shown in an error message


def _tied_aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names that share storage with another name (e.g. lm_head.weight tied to the embedding)."""
    seen: dict[int, str] = {}
    aliases = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = tensor.data_ptr()
        if key in seen:
            aliases.add(name)
        else:
            seen[key] = name
    return aliases


@torch.no_grad()
def copy_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       *, strict: bool = False) -> list[str]:
    """Copy tensors into the model's parameters/buffers by HF name (dtype cast to the model's).

    ``strict``: every state-dict entry must be given (tied aliases excepted). Unknown names and shape
    mismatches raise with the offending name. Returns the names loaded.
    """
    state = model.state_dict(keep_vars=True)
    loaded = []
    for name, tensor in named_tensors:
        if name not in state:
            valid = ", ".join(sorted(state)[:_MAX_LISTED])
            raise KeyError(f"weight '{name}' is not a parameter of the rollout model (e.g. {valid}, ...)")
        target = state[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight '{name}': shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
            )
        target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        loaded.append(name)
    if strict:
        missing = sorted(set(state) - set(loaded) - _tied_aliases(model))
        if missing:
            raise KeyError(f"state dict is missing {len(missing)} weights: {', '.join(missing[:_MAX_LISTED])}")
    return loaded


def read_hf_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model directory (``model.safetensors`` or a sharded index)."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json found")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(path / name)))
    return tensors
