"""Megatron distributed checkpoints (torch_dist) of the learner, reshardable across TP x PP layouts.

A checkpoint directory holds the ``dist_checkpointing`` files (model, optionally optimizer + scheduler +
learner counters), ``sparse_rl_checkpoint.json`` (the HF config and the ``ModelArch`` it was built from) and
``hf_assets/`` (tokenizer, chat template, generation config) so it can be exported back to HF alone.
Global tensor shapes do not depend on the layout (the vocabulary padding multiple is TP-independent, see
``models/arch.py``), so a checkpoint saved at one TP x PP loads at any other.

Portable across Transformer Engine and no TE: modules may carry ``_extra_state`` (TE >= 2.0 modules, the final
norm megatron builds from TE whenever TE imports, hold an empty byte tensor without fp8; megatron's own linear
layers hold None). Extra states that carry nothing are not saved, and on load only the extra states the
checkpoint holds are read; a module whose extra state is absent keeps its default. So a checkpoint written
without TE (every CPU run and ``convert``) loads on a TE learner and the other way round.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sparse_rl_megatron.learner import cpu_compat, distopt_fixes
from sparse_rl_megatron.learner.hf_io import copy_hf_assets
from sparse_rl_megatron.learner.model_provider import unwrap
from sparse_rl_megatron.learner.save_children import children_die_with_us
from sparse_rl_megatron.models.arch import ModelArch

META_FILE = "sparse_rl_checkpoint.json"
EXTRA_STATE_SUFFIX = "_extra_state"
ASSETS_DIR = "hf_assets"
FORMAT_VERSION = 1


def read_meta(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The learner metadata of a checkpoint directory; a clear error if it is not one."""
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        hint = " (it looks like an HF checkpoint: convert it with `sparse-rl convert hf-to-megatron`)" if (
            Path(ckpt_dir) / "config.json").is_file() else ""
        raise FileNotFoundError(f"{path} not found: {ckpt_dir} is not a sparse-rl Megatron checkpoint{hint}")
    return json.loads(path.read_text())


def check_arch(meta: dict[str, Any], arch: ModelArch, ckpt_dir: str | os.PathLike) -> None:
    """Refuse a checkpoint built for another architecture, naming every differing field."""
    diffs = arch.differences(ModelArch.from_dict(meta["arch"]))
    if diffs:
        raise ValueError(
            f"checkpoint {ckpt_dir} is for another architecture (model vs checkpoint): " + "; ".join(diffs)
        )


def _check_tensor_shapes(sharded_sd: dict, ckpt_dir: str) -> None:
    """Compare every model tensor's global shape with the checkpoint's; name the mismatches."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    stored = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    tensors, _ = extract_sharded_tensors_and_factories(sharded_sd)
    problems = []
    for st in _flatten(tensors):
        if not isinstance(st, ShardedTensor):
            continue
        if st.key not in stored:
            problems.append(f"{st.key}: missing from the checkpoint")
        elif tuple(stored[st.key].global_shape) != tuple(st.global_shape):
            problems.append(f"{st.key}: checkpoint {tuple(stored[st.key].global_shape)} vs model {tuple(st.global_shape)}")
    if problems:
        raise ValueError(f"checkpoint {ckpt_dir} does not fit this model: " + "; ".join(sorted(set(problems))[:8]))


def _flatten(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flatten(v)
    else:
        yield obj


def _is_extra_state(key: str) -> bool:
    return key.endswith(EXTRA_STATE_SUFFIX)


def _carries_nothing(data: Any) -> bool:
    """True for the extra states that hold no weights: None, an empty tensor, empty bytes."""
    if data is None:
        return True
    if isinstance(data, torch.Tensor):
        return data.numel() == 0
    if isinstance(data, io.BytesIO):
        return data.getbuffer().nbytes == 0
    return isinstance(data, (bytes, bytearray)) and len(data) == 0


def _portable_model_state(sharded_sd: dict[str, Any], stored_objects: set[str] | None = None) -> dict[str, Any]:
    """The model's sharded state dict without the extra states that must not travel.

    Saving (``stored_objects`` None): drop extra states that carry nothing. Loading: drop the extra states
    the checkpoint does not hold (``stored_objects``: the keys of its sharded objects).
    """
    def keep(key: str, value: Any) -> bool:
        if not _is_extra_state(key):
            return True
        if stored_objects is None:
            return not _carries_nothing(getattr(value, "data", value))
        return getattr(value, "key", key) in stored_objects

    return {k: v for k, v in sharded_sd.items() if keep(k, v)}


def _stored_object_keys(ckpt_dir: str) -> set[str]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {v.key for v in load_sharded_metadata(ckpt_dir).values() if isinstance(v, ShardedObject)}


def _state(model, optimizer, scheduler, extra: dict | None, is_loading: bool,
           stored_objects: set[str] | None = None) -> dict[str, Any]:
    sd: dict[str, Any] = {"model": _portable_model_state(unwrap(model).sharded_state_dict(), stored_objects)}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(sd["model"], is_loading=is_loading,
                                                       metadata=distopt_fixes.OPTIMIZER_METADATA)
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    if extra is not None:
        sd["learner"] = dict(extra)
    return sd


def _staging_dir(out: Path) -> Path:
    return out.with_name(out.name + ".saving")


def _commit(staging: Path, out: Path) -> None:
    """Put the finished ``staging`` directory in place of ``out`` (rank 0). The renames are the commit:
    a crash before them leaves ``out`` as it was; between them, no ``out`` at all (``<out>.old`` holds the
    previous checkpoint); never a directory that mixes two saves."""
    import shutil

    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        staging.rename(out)
        shutil.rmtree(old)
    else:
        staging.rename(out)


@cpu_compat.in_device_mode
def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    model,
    arch: ModelArch,
    hf_config: dict[str, Any],
    *,
    optimizer=None,
    scheduler=None,
    extra: dict[str, Any] | None = None,
    assets_dir: str | os.PathLike | None = None,
) -> Path:
    """Save (collective: every rank calls it). ``extra`` is a small dict of learner counters.

    Atomic: everything is written to ``<ckpt_dir>.saving`` (metadata last) and renamed into place only when
    complete, so a crash mid-save never leaves a directory that looks like a finished checkpoint (megatron's
    own ``save`` overwrites in place). An existing ``ckpt_dir`` is replaced only if it is a sparse-rl
    checkpoint or empty.
    """
    import shutil

    from megatron.core import dist_checkpointing

    out = Path(ckpt_dir)
    if out.exists() and not (out / META_FILE).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not a sparse-rl Megatron checkpoint; refusing to replace it")
    staging = _staging_dir(out)

    def prepare():
        shutil.rmtree(staging, ignore_errors=True)  # leftovers of a save that crashed
        staging.mkdir(parents=True)

    def finish():
        if assets_dir is not None:
            copy_hf_assets(assets_dir, staging / ASSETS_DIR)
        meta = {"format_version": FORMAT_VERSION, "arch": arch.to_dict(), "hf_config": hf_config,
                "has_optimizer": optimizer is not None}
        (staging / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _commit(staging, out)

    _on_rank0_for_all(prepare)
    with children_die_with_us():  # a write that fails on any rank raises on every rank (megatron gathers them)
        dist_checkpointing.save(_state(model, optimizer, scheduler, extra, is_loading=False), str(staging))
    _on_rank0_for_all(finish)
    return out


def _on_rank0_for_all(fn) -> None:
    """Run ``fn`` on rank 0, then sync every rank; an ``OSError`` there (disk full, ...) is raised on every rank,
    where the others would otherwise wait for rank 0 in the next collective."""
    failure = None
    if dist.get_rank() == 0:
        try:
            fn()
        except OSError as err:
            failure = err
    box = [None if failure is None else (failure.errno, failure.strerror or str(failure))]
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0] is not None:
        raise OSError(box[0][0], f"{box[0][1]} (on rank 0)")


@cpu_compat.in_device_mode
def load_checkpoint(
    ckpt_dir: str | os.PathLike, model, arch: ModelArch, *, optimizer=None, scheduler=None
) -> dict[str, Any]:
    """Load into an already built model (and optimizer/scheduler when given) at any layout.

    Returns the saved ``extra`` counters (empty when none). Refuses another architecture before reading
    tensors, and names tensors whose global shapes differ.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = str(ckpt_dir)
    meta = read_meta(ckpt_dir)
    check_arch(meta, arch, ckpt_dir)
    if optimizer is not None and not meta.get("has_optimizer", False):
        raise ValueError(f"checkpoint {ckpt_dir} holds no optimizer state; load it without the optimizer")
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    sd = _state(model, optimizer, scheduler, common.get("learner"), is_loading=True,
                stored_objects=_stored_object_keys(ckpt_dir))
    _check_tensor_shapes(sd["model"], ckpt_dir)
    sd.pop("scheduler", None)
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    result = unwrap(model).load_state_dict(loaded["model"], strict=False)
    problems = [f"missing {k}" for k in result.missing_keys if not _is_extra_state(k)]
    problems += [f"unexpected {k}" for k in result.unexpected_keys]
    if problems:  # only extra states may be absent (see the module docstring)
        raise ValueError(f"checkpoint {ckpt_dir} does not fit this model: " + "; ".join(problems[:8]))
    if optimizer is not None:
        with torch.no_grad():  # param views are loaded in place
            optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and "scheduler" in common:
        scheduler.num_steps = 0  # megatron's load_state_dict adds the saved count to the live one
        scheduler.load_state_dict(common["scheduler"])
    return dict(common.get("learner") or {})
