"""Where the evaluated weights come from: an HF directory, or a Megatron checkpoint exported to HF first.

The seam for Megatron checkpoints is ``sparse_rl_megatron.learner.convert.export_to_hf(megatron_dir,
out_dir)``, imported only when such a checkpoint is given (evaluation of HF models needs no megatron-core).
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# Files that mark a directory as an HF model, and as a Megatron checkpoint (the learner's own metadata file,
# the torch_dist metadata of megatron-core's dist_checkpointing, Megatron-LM's iteration tracker).
_HF_MARKERS = ("config.json",)
_MEGATRON_MARKERS = ("sparse_rl_checkpoint.json", "metadata.json", "latest_checkpointed_iteration.txt")


def is_hf_dir(path: str | os.PathLike) -> bool:
    return all((Path(path) / m).is_file() for m in _HF_MARKERS)


def is_megatron_checkpoint(path: str | os.PathLike) -> bool:
    return not is_hf_dir(path) and any((Path(path) / m).is_file() for m in _MEGATRON_MARKERS)


def resolve_hf_model(path: str | os.PathLike, export_dir: str | os.PathLike | None = None) -> Path:
    """An HF directory to load: ``path`` itself, or the HF export of the Megatron checkpoint at ``path``.

    ``export_dir``: where the export goes (default: a new temporary directory, left for the caller to
    remove). Raises a clear error for anything else, and when the converter is not available.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} is not a directory (expected an HF model directory or a "
                                "Megatron checkpoint directory)")
    if is_hf_dir(path):
        return path
    if is_megatron_checkpoint(path):
        try:
            from sparse_rl_megatron.learner.convert import export_to_hf
        except ImportError as exc:
            raise RuntimeError(
                f"{path} is a Megatron checkpoint; evaluating it needs the converter "
                f"sparse_rl_megatron.learner.convert.export_to_hf, which could not be imported ({exc}). "
                "Export it to HF yourself (`sparse-rl convert`) and pass the HF directory."
            ) from exc
        out = Path(export_dir) if export_dir else Path(tempfile.mkdtemp(prefix="sparse-rl-eval-export-"))
        log.info("exporting Megatron checkpoint %s to HF at %s", path, out)
        return Path(export_to_hf(path, out))
    raise ValueError(
        f"{path} is neither an HF model directory (no {', '.join(_HF_MARKERS)}) nor a Megatron checkpoint "
        f"(none of {', '.join(_MEGATRON_MARKERS)})"
    )
