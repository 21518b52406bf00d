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

from sparse_rl_megatron.learner.model_provider import expert_offset, layer_offset_of, unwrap
from sparse_rl_megatron.models import weight_map as wm
from sparse_rl_megatron.models.arch import ModelArch, arch_from_hf_config, read_hf_config

# Files of an HF checkpoint directory that are not weights and travel unchanged (tokenizer, templates).
HF_ASSET_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_FILES = (_INDEX_FILE,)


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

    ckpt_arch, _ = read_arch(hf_dir)
    diffs = arch.differences(ckpt_arch)
    if diffs:
        raise ValueError(f"HF checkpoint {hf_dir} is for another architecture: " + "; ".join(diffs))
    reader = SafetensorsReader(hf_dir)
    wm.check_hf_tensors(arch, reader.shapes())
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    inner = unwrap(model)
    offset, experts_from = layer_offset_of(inner), expert_offset(inner)
    count = 0
    for local_name, param in inner.named_parameters():
        name = wm.canonical_name(local_name, offset, experts_from)
        kind = wm.param_kind(name)
        padded = param.shape[0] * tp if kind == "vocab" else None
        rank, size = ((ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
                      if kind in wm.EXPERT_KINDS else (tp_rank, tp))
        shard = wm.hf_to_mcore(arch, name, reader.get, tp_rank=rank, tp_size=size, padded_vocab=padded)
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


# Largest safetensors file written (HF's own default shard size): the writer holds at most this much on the host.
DEFAULT_SHARD_BYTES = 5 * 10**9


class HFCheckpointWriter:
    """Writes an HF checkpoint directory tensor by tensor, so no caller needs the whole model at once.

    ``add`` copies each tensor to the host (a fresh tensor, not a view into a larger buffer) and writes a
    safetensors shard whenever ``shard_bytes`` have gathered; ``close`` names the shards (``model.safetensors``
    when there is one, ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` otherwise) and
    writes ``config.json`` and the tokenizer/template files of ``assets_dir`` (its ``config.json`` kept as is
    when present; otherwise ``hf_config`` is written). Either way its ``dtype`` (and legacy ``torch_dtype``)
    names the dtype of the tensors written when ``dtype`` is given.
    """

    def __init__(self, out_dir: str | os.PathLike, hf_config: dict, assets_dir: str | os.PathLike | None = None,
                 dtype: torch.dtype | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.hf_config, self.assets_dir, self.dtype, self.shard_bytes = hf_config, assets_dir, dtype, shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per written shard, in order
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu")
        if self.dtype is not None:
            t = t.to(self.dtype)
        t = t.contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view into a bucket's flat buffer would keep the whole buffer alive
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self._pending, str(self.out / f"shard-{len(self._shards)}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> Path:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        names = [_SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            (self.out / f"shard-{i}.tmp").rename(self.out / name)
        if n > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self._shards) for t in shard}
            index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / _INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        copied = copy_hf_assets(self.assets_dir, self.out) if self.assets_dir is not None else []
        config_path, hf_config = self.out / "config.json", self.hf_config
        if "config.json" in copied:
            hf_config = json.loads(config_path.read_text())
        written = str(self.dtype).removeprefix("torch.") if self.dtype is not None else None
        keys = [k for k in ("dtype", "torch_dtype") if k in hf_config] or ["dtype"]
        stale = written is not None and any(hf_config.get(k) != written for k in keys)
        if stale:  # config.json names the dtype of the tensors written
            hf_config = {**hf_config, **dict.fromkeys(keys, written)}
        if stale or "config.json" not in copied:  # a copied config.json that is still right stays byte for byte
            config_path.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        return self.out


def save_hf_checkpoint(
    out_dir: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    hf_config: dict,
    assets_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``tensors`` as an HF checkpoint (safetensors shards + ``config.json`` + tokenizer/template files
    from ``assets_dir``), consuming the iterable one tensor at a time (see ``HFCheckpointWriter``)."""
    writer = HFCheckpointWriter(out_dir, hf_config, assets_dir=assets_dir, dtype=dtype, shard_bytes=shard_bytes)
    for name, t in tensors:
        writer.add(name, t)
    return writer.close()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (float32, bfloat16, float16)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]
