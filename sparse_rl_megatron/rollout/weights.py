"""Loading HF-named weights into a live HF model (weight sync from the trainer, or an HF directory)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch

from sparse_rl_megatron.rollout.fused_experts import fused_coverage, fused_slice

_MAX_LISTED = 8  # names shown in an error message


def _is_pair(item) -> bool:
    return isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)


def iter_buckets(named_tensors: Iterable) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(hf_name, tensor) pairs or buckets (lists of pairs), possibly lazy -> buckets, one at a time (consecutive
    loose pairs form one bucket). Raises ``TypeError`` on anything else."""
    loose: list[tuple[str, torch.Tensor]] = []
    for item in named_tensors:
        if _is_pair(item):
            loose.append((item[0], item[1]))
            continue
        if not (isinstance(item, (list, tuple)) and all(_is_pair(x) for x in item)):
            raise TypeError(f"update_weights: expected (hf_name, tensor) pairs or buckets of them, got {type(item)}")
        if loose:
            yield loose
            loose = []
        yield [(n, t) for n, t in item]
    if loose:
        yield loose


def iter_pairs(named_tensors: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) pairs or buckets of them, possibly lazy -> pairs, one at a time."""
    for bucket in iter_buckets(named_tensors):
        yield from bucket


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
    mismatches raise with the offending name. Returns the names loaded. A mixture of experts' per-expert
    checkpoint tensors go into their slices of the model's fused expert tensors (``fused_experts.py``); a fused
    tensor counts as given once every slice was.
    """
    state = model.state_dict(keep_vars=True)
    loaded = []
    parts: dict[str, int] = {}
    for name, tensor in named_tensors:
        target = state.get(name)
        if target is None:
            fused = fused_slice(state, name)
            if fused is None:
                valid = ", ".join(sorted(state)[:_MAX_LISTED])
                raise KeyError(f"weight '{name}' is not a parameter of the rollout model (e.g. {valid}, ...)")
            parts[fused[0]] = parts.get(fused[0], 0) + 1
            target = fused[1]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight '{name}': shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
            )
        target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        loaded.append(name)
    if strict:
        whole = {f for f, count in parts.items() if count == fused_coverage(state, f)}
        missing = sorted(set(state) - set(loaded) - whole - _tied_aliases(model))
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
