"""Tiny models and a tiny tokenizer built in code, for tests, benchmarks and the CPU default run.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a small embedded corpus, with a
Qwen2.5-style chat template (``<|im_start|>``/``<|im_end|>``), so any text encodes and decodes losslessly.
Models are randomly initialised HF models of any registered family (``models.families``: Qwen2, Llama, Qwen3 and
the mixtures of experts Qwen3-MoE / Qwen2-MoE; each spec's ``tiny_config`` builds its config) with a fixed seed.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from sparse_rl_megatron.models.families import FAMILY_SPECS, TinyRequest, family_spec

BOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Qwen2.5's chat template, reduced to what the tests and templates use (system + user + assistant turns).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = [
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Let x be a real number such that x^2 - 5x + 6 = 0. Find the sum of all possible values of x.",
    "The answer is \\boxed{5}. So the final answer is 5.",
    "We compute \\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}, and therefore the result is \\frac{5}{6}.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "First, 2 + 3 = 5. Then 5 * 4 = 20. Finally 20 - 7 = 13.",
    "The area of a circle with radius r is \\pi r^2, and its circumference is 2\\pi r.",
    "If a triangle has sides 3, 4 and 5, it is a right triangle because 3^2 + 4^2 = 5^2.",
    "Solve for y: 3y + 7 = 22. Subtract 7 from both sides to get 3y = 15, so y = 5.",
    "The probability of rolling a sum of 7 with two dice is \\frac{6}{36} = \\frac{1}{6}.",
    "Let f(x) = 2x + 1. Then f(f(3)) = f(7) = 15.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 0.5 0.25 3.14",
    "\\sqrt{2} \\sqrt{18} = 6, \\sin(x), \\cos(x), \\tan(x), \\log_2 8 = 3, \\left( \\right) \\{ \\} [ ]",
    "Therefore, the number of ways is \\binom{5}{2} = 10. Hence the answer is \\boxed{10}.",
    "user assistant system You are a helpful assistant.",
]


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@functools.lru_cache(maxsize=4)
def _cached_tokenizer_dir(vocab_size: int) -> str:
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=f"sparse-rl-tiny-tok-{vocab_size}-"))
    _train_tokenizer(vocab_size).save_pretrained(path)
    return str(path)


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ``vocab_size`` entries (special tokens included).

    EOS is ``<|im_end|>`` (as in Qwen2.5 chat models); PAD is ``<|endoftext|>``. Deterministic.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_cached_tokenizer_dir(vocab_size), local_files_only=True)


def tiny_config(
    family: str = "qwen2",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool | None = None,
    max_position_embeddings: int = 8192,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    head_dim: int | None = None,
    num_experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate_size: int | None = None,
    shared_expert_intermediate_size: int | None = None,
    norm_topk_prob: bool | None = None,
):
    """An HF config for a tiny model of ``family`` (a ``models.families`` name; its spec's ``tiny_config`` builds
    it): ``qwen2`` (QKV bias), ``llama`` (no bias) or ``qwen3`` (no bias, q/k norms), or a tiny mixture of experts:
    ``qwen3_moe`` (Qwen3 attention, ``num_experts`` routed experts of width ``moe_intermediate_size``, default
    ``hidden_size``, top-``experts_per_token``, weights renormalised) or ``qwen2_moe`` (Qwen2 attention, the same plus
    a shared expert of ``shared_expert_intermediate_size``, default ``2 x hidden_size``, not renormalised).
    ``rope_scaling``: e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``; ``head_dim``: qwen3 / qwen3_moe only
    (default ``hidden_size // num_heads``). ``tie_word_embeddings``: default the spec's ``tiny_tied``: tied for the
    dense families, untied for the mixtures of experts (as every published Qwen MoE; SGLang 0.5.23's MoE models do
    not tie the LM head)."""
    if family not in FAMILY_SPECS:
        raise ValueError(f"tiny_config: unknown family '{family}'; valid: {', '.join(FAMILY_SPECS.names())}")
    spec = family_spec(family)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        tie_word_embeddings=spec.tiny_tied if tie_word_embeddings is None else tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    return spec.tiny_config(TinyRequest(
        common=common, head_dim=head_dim or hidden_size // num_heads, num_experts=num_experts,
        experts_per_token=experts_per_token, moe_intermediate_size=moe_intermediate_size or hidden_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size or 2 * hidden_size,
        norm_topk_prob=norm_topk_prob))


def build_tiny_model(family: str = "qwen2", *, seed: int = 0, init_std: float = 0.02, **config_kwargs):
    """A randomly initialised HF causal LM in float32, eval mode, with a fixed ``seed``.

    ``init_std`` sets the initializer range: the default gives near-uniform next-token distributions;
    a larger value (e.g. 0.2) gives peaked ones, useful when a test needs attention patterns to matter.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **config_kwargs)
    config.initializer_range = init_std
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def save_tiny_hf_checkpoint(out_dir: str | os.PathLike, family: str = "qwen2", *, seed: int = 0,
                            init_std: float = 0.02, **config_kwargs) -> Path:
    """Write a tiny model + matching tokenizer as an HF directory (safetensors, config, tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = config_kwargs.setdefault("vocab_size", 512)
    model = build_tiny_model(family, seed=seed, init_std=init_std, **config_kwargs)
    model.save_pretrained(out)
    build_tiny_tokenizer(vocab_size).save_pretrained(out)
    return out
