"""When a sample stops: EOS, a stop string, or the token limit."""
from __future__ import annotations

from typing import Sequence

# A character is at most 4 UTF-8 bytes and a byte-level token holds at least one byte, so a stop string
# of c characters spans at most 4c tokens (+1 for a partial token at the start of the decoded tail).
_TOKENS_PER_CHAR = 4


class StopChecker:
    """Finish reasons for one generate call: ``eos`` | ``stop`` | ``length`` | None (still running)."""

    def __init__(self, *, eos_ids: Sequence[int], stop: Sequence[str], ignore_eos: bool,
                 max_new_tokens: int, tokenizer=None):
        if stop and tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer (the engine was built without one)")
        self.eos_ids = set() if ignore_eos else set(int(t) for t in eos_ids)
        self.stop = list(stop)
        self.max_new_tokens = max_new_tokens
        self.tokenizer = tokenizer
        self.tail = _TOKENS_PER_CHAR * max((len(s) for s in self.stop), default=0) + 1

    def check(self, response_ids: list[int], prefix: Sequence[int] = ()) -> str | None:
        """Reason the sample must stop after its last token, or None. ``prefix``: the response's tokens sampled by
        earlier calls (a continued rollout): stop strings may span it; the token limit counts this call's tokens."""
        if response_ids[-1] in self.eos_ids:
            return "eos"
        if self.stop:
            tail = response_ids[-self.tail:]
            if len(tail) < self.tail and prefix:
                tail = [*prefix[len(tail) - self.tail:], *tail]
            text = self.tokenizer.decode(tail, skip_special_tokens=False)
            if any(s in text for s in self.stop):
                return "stop"
        if len(response_ids) >= self.max_new_tokens:
            return "length"
        return None
