"""Prompt and response lengths against the model and the KV budget, checked before the model loads.

- ``context_error``: a benchmark's longest prompt plus its ``max_new_tokens`` must fit the model's context
  (``max_position_embeddings``, what the engines enforce); otherwise the message says which option to lower
  and to what.
- ``dense_prompts``: how many prompts can never reach a compression within ``max_new_tokens`` (their samples
  decode on the full KV cache, so a "compressed" result for them is a dense one).
"""
from __future__ import annotations

from typing import Sequence

from sparse_rl_megatron.compression.schedule import CompressionSchedule


def prompt_token_counts(prompts: Sequence[str], tokenizer) -> list[int]:
    """Token count of each rendered prompt, encoded as the engines encode it (the template holds the special
    tokens, none are added)."""
    return [len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]


def context_error(benchmark: str, longest_prompt: int, max_new_tokens: int, context: int) -> str | None:
    """Why ``longest_prompt + max_new_tokens`` does not fit ``context`` (None when it fits)."""
    if longest_prompt + max_new_tokens <= context:
        return None
    room = context - longest_prompt
    head = (f"{benchmark}: the longest prompt ({longest_prompt} tokens) + {max_new_tokens} new tokens exceed the "
            f"model's context of {context} tokens (max_position_embeddings)")
    if room < 1:
        return f"{head}; the prompt alone fills it: leave {benchmark} out of --benchmarks"
    return (f"{head}; lower --max-new-tokens to {room} or less (or for this benchmark alone: "
            f"--bench {benchmark}:max_new_tokens={room})")


def dense_prompts(schedule: CompressionSchedule, prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
    """How many of the prompts never compress, even when their response runs to ``max_new_tokens``."""
    return sum(not schedule.may_compress(n, max_new_tokens) for n in prompt_lengths)
