"""Prompt templates by name: exact text of each, the tokenizer's own template, and name errors."""
import pytest

from sparse_rl_megatron.data import COT_INSTRUCTION, TEMPLATES, render_prompt
from sparse_rl_megatron.utils.registry import UnknownNameError


def test_instruction_is_the_reference_one():
    assert COT_INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."


def test_qwen25_chat():
    assert render_prompt("qwen25_chat", "What is 1+1?") == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen25_chat_user():
    assert render_prompt("qwen25_chat_user", "What is 1+1?") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1+1?\nPlease reason step by step, and put your final answer within "
        "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_plain_completion_template():
    text = render_prompt("plain", "What is 1+1?")
    assert text == ("Question: What is 1+1?\nPlease reason step by step, and put your final answer within "
                    "\\boxed{}.\nAnswer: Let's think step by step.")
    assert "<|im_start|>" not in text


def test_tokenizer_template_uses_the_tokenizers_chat_template():
    from sparse_rl_megatron.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    # The tiny tokenizer carries Qwen2.5's template: same text as qwen25_chat_user.
    assert render_prompt("tokenizer", "What is 1+1?", tok) == render_prompt("qwen25_chat_user", "What is 1+1?")
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}[assistant] "
    assert render_prompt("tokenizer", "Q", tok) == f"[user] Q\n{COT_INSTRUCTION}[assistant] "
    with pytest.raises(ValueError, match="needs a tokenizer"):
        render_prompt("tokenizer", "Q")


def test_unknown_template_lists_the_valid_names():
    assert TEMPLATES.names() == ["plain", "qwen25_chat", "qwen25_chat_user", "raw", "tokenizer"]
    with pytest.raises(UnknownNameError, match="valid names: plain, qwen25_chat"):
        render_prompt("llama3", "Q")
