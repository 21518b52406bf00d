"""Inputs of the command-line tests that must be refused (or pass preflight) before any model loads (helper
module, not a test file)."""
from __future__ import annotations

import json
from pathlib import Path


def write_cli_inputs(root: Path) -> Path:
    """``root/model`` (a Qwen2 ``config.json`` and empty weights: enough for preflight, never loaded) and the data
    files ``data.jsonl`` (one problem), ``empty.jsonl`` (no row) and ``nolabel.jsonl`` (no answer field)."""
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 256}))
    (model / "model.safetensors").write_bytes(b"")
    (root / "data.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    (root / "empty.jsonl").write_text("\n")
    (root / "nolabel.jsonl").write_text(json.dumps({"prompt": "1+1?", "solution": "2"}) + "\n")
    return root
