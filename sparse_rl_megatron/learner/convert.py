"""HF <-> Megatron checkpoint conversion (the library side of ``sparse-rl convert``).

- ``import_from_hf(hf_dir, megatron_dir)``: build the model at the current layout (a single process is
  TP = PP = 1), load the HF safetensors into it and save a torch_dist checkpoint with the HF config and
  tokenizer files alongside.
- ``export_to_hf(megatron_dir, out_dir)``: model-free. Reads the checkpoint's global tensors (any layout
  saved them) and writes HF ``model.safetensors`` + ``config.json`` + tokenizer, in the HF config's dtype.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from sparse_rl_megatron.learner import checkpoint as ckpt, cpu_compat
from sparse_rl_megatron.learner.hf_io import load_hf_into_model, read_arch, save_hf_checkpoint, torch_dtype
from sparse_rl_megatron.learner.model_provider import build_stage_model
from sparse_rl_megatron.learner.parallel import init_model_parallel
from sparse_rl_megatron.models import weight_map as wm
from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.utils.device import DeviceFacts

log = logging.getLogger(__name__)

# megatron-core stores the layers of a homogeneous TransformerBlock stacked along a leading axis,
# under TE-spec names without the layer index (``decoder.layers.mlp.linear_fc1.weight``: [L, 2F, H]); routed
# experts are stacked along a second axis (``decoder.layers.mlp.experts.experts.linear_fc1.weight``: [L, E, 2F, H]).
_STACKED = re.compile(r"^decoder\.layers\.(?P<rest>[^0-9].*)$")
_STACKED_EXPERTS = re.compile(r"^mlp\.experts\.experts\.(?P<param>linear_fc[12]\.weight)$")


@cpu_compat.in_device_mode
def import_from_hf(
    hf_dir: str | os.PathLike,
    megatron_dir: str | os.PathLike,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    params_dtype: str | None = None,
) -> Path:
    """HF directory -> torch_dist checkpoint (collective when run under torchrun)."""
    facts = DeviceFacts.detect()
    arch, cfg = read_arch(hf_dir)
    init_model_parallel(tensor_parallel_size, pipeline_parallel_size, facts=facts)
    dtype = torch_dtype(params_dtype or arch.hf_dtype)
    log.info("building the %s model at TP=%d x PP=%d (%s)", arch.family, tensor_parallel_size, pipeline_parallel_size,
             dtype)
    model = build_stage_model(arch, params_dtype=dtype, spec="auto" if facts.cuda else "local", facts=facts)
    log.info("loading the HF weights of %s", hf_dir)
    load_hf_into_model(model, arch, hf_dir)
    log.info("saving the torch_dist checkpoint %s", megatron_dir)
    return ckpt.save_checkpoint(megatron_dir, model, arch, cfg, assets_dir=hf_dir)


def _canonical_tensors(arch: ModelArch, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> canonical Megatron names with full (TP = 1) tensors."""
    out: dict[str, torch.Tensor] = {}
    for key, t in stored.items():
        m = _STACKED.match(key)
        if m:
            if t.shape[0] != arch.num_layers:
                raise ValueError(f"{key}: {t.shape[0]} stacked layers vs num_layers={arch.num_layers}")
            experts = _STACKED_EXPERTS.match(m.group("rest"))
            if experts and (arch.moe is None or t.shape[1] != arch.moe.num_experts):
                raise ValueError(f"{key}: {t.shape[1]} stacked experts vs the architecture's "
                                 f"{arch.moe.num_experts if arch.moe is not None else 0}")
            for i in range(arch.num_layers):
                if experts:
                    for e in range(t.shape[1]):
                        out[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{experts.group('param')}"] = t[i, e]
                else:
                    out[wm.canonical_name(f"decoder.layers.{i}.{m.group('rest')}")] = t[i]
        else:
            out[wm.canonical_name(key)] = t
    return out


def read_global_tensors(megatron_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every model tensor of a torch_dist checkpoint, whole (shards reassembled), keyed as megatron stored it.

    Reads the torch.distributed.checkpoint files directly with ``no_dist=True``: no process group is needed,
    so it also runs on a single rank of a running job (megatron's ``load_plain_tensors`` plans the read
    collectively over the default group and would wait for the other ranks).
    """
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(megatron_dir))
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.")
    }
    with warnings.catch_warnings():  # torch warns that it assumes one process: that is the point of no_dist
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load(state, storage_reader=reader, no_dist=True)
    return state


def checkpoint_hf_tensors(megatron_dir: str | os.PathLike) -> tuple[ModelArch, dict, dict[str, torch.Tensor]]:
    """``(arch, hf_config, {hf_name: tensor})`` read from a torch_dist checkpoint without building a model."""
    meta = ckpt.read_meta(megatron_dir)
    arch = ModelArch.from_dict(meta["arch"])
    canon = _canonical_tensors(arch, read_global_tensors(megatron_dir))
    hf: dict[str, torch.Tensor] = {}
    for name in wm.mcore_param_names(arch):
        if name == wm.OUTPUT_LAYER and arch.tie_word_embeddings:
            continue
        if name not in canon:
            raise ValueError(f"checkpoint {megatron_dir} has no tensor for '{name}'")
        hf.update(wm.mcore_to_hf(arch, name, [canon[name]]))
    return arch, meta["hf_config"], hf


def export_to_hf(megatron_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None) -> Path:
    """torch_dist checkpoint -> HF directory (safetensors + config + tokenizer). Model-free, one process.

    ``dtype`` defaults to the dtype of the HF checkpoint the model came from. Written to ``<out_dir>.saving``
    and renamed into place when complete, replacing an existing ``out_dir`` as a whole (never a mix of two
    exports; the caller decides whether one may be replaced).
    """
    arch, cfg, tensors = checkpoint_hf_tensors(megatron_dir)
    assets = Path(megatron_dir) / ckpt.ASSETS_DIR
    out = Path(out_dir)
    staging = ckpt._staging_dir(out)
    shutil.rmtree(staging, ignore_errors=True)  # leftovers of an export that crashed
    save_hf_checkpoint(
        staging, sorted(tensors.items()), cfg, assets_dir=assets if assets.is_dir() else None,
        dtype=torch_dtype(dtype or arch.hf_dtype),
    )
    ckpt._commit(staging, out)
    return out
