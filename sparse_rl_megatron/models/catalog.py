"""Known model shapes by name: the architecture fields of published HF ``config.json`` files, kept as small JSON
files in ``models/configs/`` (no weights), so planning and the meta-device layout tests need no download.

``hf_config("qwen2.5-7b")`` returns the config dict (what ``arch_from_hf_config`` reads); an HF checkpoint
directory works too. Keys starting with ``_`` (the source of the facts, the model card's parameter count)
are documentation and are dropped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparse_rl_megatron.models.arch import read_hf_config

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def known_models() -> list[str]:
    """Names of the bundled configs (``qwen2.5-7b``, ``qwen3-8b``, ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def bundled_config(name: str, *, with_notes: bool = False) -> dict[str, Any]:
    """The bundled config ``name`` (case-insensitive); ``with_notes`` keeps the ``_source``-style keys."""
    path = CONFIG_DIR / f"{name.lower()}.json"
    if not path.is_file():
        raise ValueError(f"unknown model '{name}'; valid names: {', '.join(known_models())} (or an HF checkpoint "
                         f"directory with a config.json)")
    cfg = json.loads(path.read_text())
    return cfg if with_notes else {k: v for k, v in cfg.items() if not k.startswith("_")}


def hf_config(model: str) -> dict[str, Any]:
    """An HF config dict from a bundled model name or an HF checkpoint directory."""
    if Path(model).is_dir():
        return read_hf_config(model)
    return bundled_config(model)
