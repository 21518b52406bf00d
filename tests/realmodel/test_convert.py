"""``sparse-rl convert gguf-to-hf`` on SmolLM2-135M-Instruct: the HF directory holds the GGUF file's weights
(dequantized; Q/K rows back in HF order) and a working tokenizer and chat template: greedy decoding answers."""
from __future__ import annotations

import json

import numpy as np
import torch


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows of each head interleaved for its RoPE (``convert_hf_to_gguf.py``'s permute:
    ``reshape(heads, 2, d / 2, ...).swapaxes(1, 2)``); the inverse, written out independently of transformers."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_weights_are_the_gguf_files(smollm2):
    from gguf import GGUFReader, dequantize
    from safetensors.torch import load_file

    from sparse_rl_megatron.models.gguf_import import packaged_gguf

    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["tie_word_embeddings"], config["vocab_size"]) == (
        "llama", 30, 9, 3, True, 49152)
    ours = load_file(str(smollm2 / "model.safetensors"))
    assert "lm_head.weight" not in ours and len(ours) == 2 + 30 * 9  # embedding, final norm, 9 per layer
    gguf = {t.name: t for t in GGUFReader(str(packaged_gguf())).tensors}

    def read(name: str, shape) -> torch.Tensor:
        t = gguf[name]
        return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(shape)

    for src, dst in (("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"),
                     ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                     ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight")):
        assert torch.equal(read(src, ours[dst].shape), ours[dst]), dst  # exact: the same dequantization
    for src, dst, heads in (("blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight", 9),
                            ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight", 3)):
        assert torch.equal(_unpermute(read(src, ours[dst].shape), heads), ours[dst]), dst


def test_the_chat_model_answers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), local_files_only=True, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
