"""When to compress, and which tokens are candidates (the budget scope).

One definition for every engine (``docs/algorithm.md``, "KV compression: the operators and their budget"):

- Candidates: ``scope=all`` -> every cached token (prompt included); ``scope=response`` -> the response
  tokens only (the prompt is always kept whole, in front of them).
- Checks run *after* a forward pass has written its tokens' K/V and used them (so the token sampled from
  that pass attended to everything retained), and before the next token is appended. In SGLang terms:
  at the start of the next forward, before its slot is attended.
- After a decode step: compress when the candidate count reaches B + W; with ``trigger_on_newline``,
  also when the last cached token is a newline and more than B candidates are retained.
- After prefill: only with ``compress_prefill``, when more than B candidates are retained.
- A compression keeps exactly B candidates per layer and KV head.

So with scope ``all`` the retained length oscillates between B and B + W; a prompt longer than B + W
(without prefill compression) is kept whole until the first decode step, then cut to B.
"""
from __future__ import annotations

import torch

from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.compression.scorers import get_scorer


class CompressionSchedule:
    """The trigger rules of one :class:`CompressionConfig`."""

    def __init__(self, config: CompressionConfig):
        self.config = config
        self.enabled = get_scorer(config.method).compresses

    def candidate_start(self, prompt_lens: torch.Tensor) -> torch.Tensor:
        """[R] number of leading cached tokens that are never candidates (the whole prompt for scope=response)."""
        return prompt_lens if self.config.scope == "response" else torch.zeros_like(prompt_lens)

    def due_after_prefill(self, num_candidates: torch.Tensor) -> torch.Tensor:
        """Compress right after the prompt's forward pass? [R] int candidate counts -> [R] bool."""
        due = num_candidates > self.config.budget
        if not (self.enabled and self.config.compress_prefill):
            return torch.zeros_like(due)
        return due

    def due_after_decode(self, num_candidates: torch.Tensor,
                         last_is_newline: torch.Tensor | None = None) -> torch.Tensor:
        """Compress after a decode step? [R] int candidate counts (and [R] bool: the token just cached is a
        newline) -> [R] bool."""
        due = num_candidates >= self.config.max_candidates
        if not self.enabled:
            return torch.zeros_like(due)
        if self.config.trigger_on_newline and last_is_newline is not None:
            due = due | (last_is_newline & (num_candidates > self.config.budget))
        return due

    def after_prefill(self, num_candidates: int) -> bool:
        """:meth:`due_after_prefill` for one sequence."""
        return bool(self.due_after_prefill(torch.tensor([num_candidates]))[0])

    def after_decode(self, num_candidates: int, last_is_newline: bool = False) -> bool:
        """:meth:`due_after_decode` for one sequence."""
        return bool(self.due_after_decode(torch.tensor([num_candidates]), torch.tensor([last_is_newline]))[0])

    def may_compress(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Can a sequence with this prompt compress at all before it hits ``max_new_tokens``?

        False when even a response of full length keeps the candidates below the trigger: such a sequence
        decodes on the full (dense) KV cache. The most tokens ever cached are the prompt and
        ``max_new_tokens - 1`` responses (the last sampled token is never fed back), as in :meth:`capacity`.
        """
        if not self.enabled:
            return False
        c = self.config
        prompt_candidates = prompt_len if c.scope == "all" else 0
        if c.compress_prefill and prompt_candidates > c.budget:
            return True
        if max_new_tokens < 2:  # no decode step, so no check after one
            return False
        most = prompt_candidates + max_new_tokens - 1
        return most > c.budget if c.trigger_on_newline else most >= c.max_candidates

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Largest number of tokens a sequence ever holds per layer and KV head (the cache size to allocate).

        Counts the prompt, ``max_new_tokens - 1`` decode steps (the last sampled token is never fed back),
        and the peak between two compressions.
        """
        total = prompt_len + max(max_new_tokens - 1, 0)
        if not self.enabled:
            return total
        c = self.config
        if c.scope == "response":
            return min(total, prompt_len + c.max_candidates)
        decode_peak = c.max_candidates
        if not c.compress_prefill and prompt_len >= c.max_candidates:
            decode_peak = prompt_len + 1  # the first decode token is attended before the first compression
        return max(prompt_len, min(total, decode_peak))
