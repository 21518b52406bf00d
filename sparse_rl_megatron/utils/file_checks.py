"""Checks every command runs before it starts work: a bad path or file costs one line, not a traceback later.

Each check raises ``UserError`` naming the option the user set (``option``) and the file at fault.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sparse_rl_megatron.utils.errors import UserError

MEGATRON_META_FILE = "sparse_rl_checkpoint.json"
"""Marks a sparse-rl Megatron checkpoint (``learner/checkpoint.py`` writes it); kept here so checks need no torch."""
MEGATRON_ASSETS_DIR = "hf_assets"
"""Where a sparse-rl Megatron checkpoint keeps its HF config and tokenizer files (``checkpoint.ASSETS_DIR``)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A tokenizer's vocabulary (fast tokenizer, SentencePiece model, BPE vocabulary): without one, none loads."""


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a tokenizer vocabulary (one of ``TOKENIZER_FILES``)."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def read_json_file(path: str | os.PathLike, what: str = "file") -> Any:
    """Parse a JSON file; a missing, unreadable or malformed file is a ``UserError`` naming it."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{what} {path} cannot be read: {err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None


def check_model_dir(path: str | os.PathLike, option: str) -> dict[str, Any]:
    """An HF model directory or a sparse-rl Megatron checkpoint that exists and whose config parses.

    Returns the HF config dict (for a Megatron checkpoint: the one stored in its metadata).
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{option}: {path} does not exist")
    if not path.is_dir():
        raise UserError(f"{option}: {path} is not a directory (expected an HF model directory or a sparse-rl "
                        "Megatron checkpoint)")
    meta = path / MEGATRON_META_FILE
    if meta.is_file():
        data = read_json_file(meta, "checkpoint metadata")
        if not isinstance(data, dict) or not isinstance(data.get("hf_config"), dict):
            raise UserError(f"{meta} has no 'hf_config' mapping: not a sparse-rl checkpoint this version can read")
        return data["hf_config"]
    config = path / "config.json"
    if not config.is_file():
        raise UserError(f"{option}: {path} has no config.json: it is neither an HF model directory nor a sparse-rl "
                        f"Megatron checkpoint ({MEGATRON_META_FILE})")
    data = read_json_file(config, "model config")
    if not isinstance(data, dict):
        raise UserError(f"{config} must hold a JSON object, got a {type(data).__name__}")
    weights = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
    if not weights:
        raise UserError(f"{option}: {path} has a config.json but no *.safetensors weights")
    return data


def check_new_output(path: str | os.PathLike, option: str, overwrite: bool = False,
                     replaces: tuple[str, str] | None = None) -> Path:
    """An output location that is free (absent or an empty directory), unless ``overwrite``.

    ``replaces = (marker file, what it marks)``: with ``overwrite``, only a directory holding the marker (an
    earlier output of the same kind) may be replaced; any other non-empty directory is still refused.
    """
    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return path
    if not overwrite:
        raise UserError(f"{option}: {path} already exists and is not empty; choose another path or pass --overwrite")
    if replaces is not None and not (path / replaces[0]).is_file():
        raise UserError(f"{option}: {path} is not {replaces[1]} (no {replaces[0]}); --overwrite only replaces "
                        f"{replaces[1]}, never another file or directory")
    return path


def first_free_path(path: str | os.PathLike, companions: tuple[str, ...] = ()) -> Path:
    """``path`` if nothing is there, else the first free ``<stem>-2<suffix>``, ``<stem>-3<suffix>``, ...: a default
    output name that never replaces an earlier output. ``companions``: other suffixes written beside it (e.g.
    ``(".png",)``) that must be free under the same name too."""
    path = Path(path)
    candidate, k = path, 1
    while candidate.exists() or any(candidate.with_suffix(s).exists() for s in companions):
        k += 1
        candidate = path.with_name(f"{path.stem}-{k}{path.suffix}")
    return candidate
