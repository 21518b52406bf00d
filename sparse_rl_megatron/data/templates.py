"""Prompt templates by name: a problem text -> the text the model is given.

- ``qwen25_chat``: Qwen2.5(-Math) chat turns with the system instruction "Please reason step by step, and
  put your final answer within \\boxed{}." and the problem as the user turn, as in the reference runs.
- ``qwen25_chat_user``: the same instruction appended to the user turn, default Qwen system prompt.
- ``plain``: a completion prompt for base models (no chat tokens).
- ``raw``: the problem text unchanged (tasks built in code, whose problems are already the model input).
- ``tokenizer``: the tokenizer's own chat template (``apply_chat_template``) around problem + instruction.
"""
from __future__ import annotations

from typing import Any, Callable

from sparse_rl_megatron.utils.registry import Registry

COT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

Template = Callable[[str, Any], str]
TEMPLATES: Registry[Template] = Registry("prompt template")


@TEMPLATES.register("qwen25_chat")
def qwen25_chat(problem: str, tokenizer: Any = None) -> str:
    """Qwen2.5-Math CoT chat prompt: instruction as the system turn, problem as the user turn."""
    return (
        f"<|im_start|>system\n{COT_INSTRUCTION}<|im_end|>\n"
        f"<|im_start|>user\n{problem}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@TEMPLATES.register("qwen25_chat_user")
def qwen25_chat_user(problem: str, tokenizer: Any = None) -> str:
    """Qwen2.5 chat prompt with the default system turn and the instruction after the problem."""
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{problem}\n{COT_INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@TEMPLATES.register("plain")
def plain(problem: str, tokenizer: Any = None) -> str:
    """Completion prompt for base models."""
    return f"Question: {problem}\n{COT_INSTRUCTION}\nAnswer: Let's think step by step."


@TEMPLATES.register("raw")
def raw(problem: str, tokenizer: Any = None) -> str:
    """The problem text as is (for tasks built in code with their own vocabulary)."""
    return problem


@TEMPLATES.register("tokenizer")
def tokenizer_chat(problem: str, tokenizer: Any = None) -> str:
    """The tokenizer's chat template with one user turn (problem + instruction) and the generation prompt."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt template 'tokenizer' needs a tokenizer that has a chat_template; "
                         f"valid templates without one: {', '.join(n for n in TEMPLATES.names() if n != 'tokenizer')}")
    messages = [{"role": "user", "content": f"{problem}\n{COT_INSTRUCTION}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_prompt(template: str, problem: str, tokenizer: Any = None) -> str:
    """Apply the template named ``template`` to ``problem``."""
    return TEMPLATES.get(template)(problem, tokenizer)
