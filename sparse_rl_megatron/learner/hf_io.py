"""Read HF safetensors checkpoints straight into any TP x PP layout, and write HF checkpoints.

Each rank reads only the HF tensors its own parameters need (lazily, through ``safe_open``), builds its
TP shard with ``models.weight_map.hf_to_mcore`` and copies it into the parameter.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

from sparse_rl_megatron.models import weight_map as wm
from sparse_rl_megatron.models.arch import ModelArch, arch_from_hf_config, read_hf_config

# Files of an HF checkpoint directory that are not weights and travel unchanged (tokenizer, templates).
HF_ASSET_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_WEIGHT_FILES = ("model.safetensors.index.json",)


class SafetensorsReader:
    """Lazy access to the tensors of an HF checkpoint directory (one file or an indexed set of shards)."""

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.dir}")
        self._handles = {f: safe_open(str(f), framework="pt") for f in files}
        self._where: dict[str, Path] = {}
        for f, h in self._handles.items():
            for k in h.keys():
                self._where[k] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(self._handles[f].get_slice(k).get_shape()) for k, f in self._where.items()}

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"tensor '{name}' not found in the HF checkpoint {self.dir}")
        return self._handles[self._where[name]].get_tensor(name)


def read_arch(hf_dir: str | os.PathLike) -> tuple[ModelArch, dict]:
    """``(ModelArch, config dict)`` of an HF checkpoint directory."""
    cfg = read_hf_config(hf_dir)
    return arch_from_hf_config(cfg), cfg


@torch.no_grad()
def load_hf_into_model(model, arch: ModelArch, hf_dir: str | os.PathLike) -> int:
    """Copy HF weights into this rank's stage model (any TP x PP). Returns the number of parameters set.

    Refuses a checkpoint whose config or tensors do not fit ``arch``, naming the differing fields.
    """
    from megatron.core import parallel_state as ps

    from sparse_rl_megatron.learner.model_provider import layer_offset_of, unwrap

    ckpt_arch, _ = read_arch(hf_dir)
    diffs = arch.differences(ckpt_arch)
    if diffs:
        raise ValueError(f"HF checkpoint {hf_dir} is for another architecture: " + "; ".join(diffs))
    reader = SafetensorsReader(hf_dir)
    wm.check_hf_tensors(arch, reader.shapes())
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    inner = unwrap(model)
    offset = layer_offset_of(inner)
    count = 0
    for local_name, param in inner.named_parameters():
        name = wm.canonical_name(local_name, offset)
        padded = param.shape[0] * tp if wm.param_kind(name) == "vocab" else None
        shard = wm.hf_to_mcore(arch, name, reader.get, tp_rank=tp_rank, tp_size=tp, padded_vocab=padded)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"{local_name}: HF-derived shard {tuple(shard.shape)} vs model {tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))
        count += 1
    return count


def copy_hf_assets(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy the non-weight files (config, tokenizer, chat template, generation config) of an HF directory."""
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name.endswith(HF_ASSET_SUFFIXES) and f.name not in _WEIGHT_FILES:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def save_hf_checkpoint(
    out_dir: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    hf_config: dict,
    assets_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (+ tokenizer/template files from ``assets_dir``).

    The ``config.json`` of ``assets_dir`` is kept as is when present; otherwise ``hf_config`` is written. Either
    way its ``dtype`` (and legacy ``torch_dtype``) names the dtype of the tensors written when ``dtype`` is given.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    copied = copy_hf_assets(assets_dir, out) if assets_dir is not None else []
    state = {}
    for name, t in tensors:
        t = t.detach().to("cpu")
        state[name] = (t.to(dtype) if dtype is not None else t).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_path = out / "config.json"
    if "config.json" in copied:
        hf_config = json.loads(config_path.read_text())
    written = str(dtype).removeprefix("torch.") if dtype is not None else None
    keys = [k for k in ("dtype", "torch_dtype") if k in hf_config] or ["dtype"]
    stale = written is not None and any(hf_config.get(k) != written for k in keys)
    if stale:  # config.json names the dtype of the tensors written
        hf_config = {**hf_config, **dict.fromkeys(keys, written)}
    if stale or "config.json" not in copied:  # a copied config.json that is still right stays byte for byte
        config_path.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return out


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (float32, bfloat16, float16)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]
