"""Problems of the ``modchain`` task: iterate ``x <- (a * x + b) mod 10`` from ``x0`` for N steps.

Text formats: words separated by single spaces, each word one token (``word_tokenizer.py``; under Qwen2's
pre-tokenizer a token cannot mix letters and digits, so numbers inside words are spelt out):

- prompt: ``Q`` then the tags of ``x0``, ``a``, ``b`` and D distractor tags (other letters, random digits) in a
  random order, then ``:``. E.g. ``Q cFour aSeven eOne xThree fZero bTwo dNine :`` (x0 = 3, a = 7, b = 2).
  A tag is one token (letter and digit merged), so the parameters are a few salient prompt tokens that any
  step can attend to by content.
- worked solution (chain of thought, then the final answer): ``sOne <x1> sTwo <x2> ... sThirty <xN> \\boxed{xN}``
  with the states as digit words (``seven``) and the answer in digits: ``sOne three sTwo six ... \\boxed{4}``.
  A response is 2N words plus the answer's 5 tokens (``\\``, ``boxed``, ``{``, digit, ``}``) plus EOS.

Every step needs the previous state (local) and ``a``, ``b`` from the prompt, and errors compound over the
N steps. The answer depends only on ``(x0, a, b)``: 10 x 4 x 10 = 400 problems. The split is made on these
triples with a fixed seed (``SPLIT_SEED``), independent of any run seed, so train and held-out problems can
never be the same problem, whatever the distractors.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

MODULUS = 10
MULTIPLIERS = (1, 3, 7, 9)
"""Units mod 10: the map is a bijection, so chains never collapse to a fixed point."""
DISTRACTOR_LETTERS = "cdefghkmnpr"
PARAM_LETTERS = ("x", "a", "b")
PROMPT_START = "Q"
PROMPT_END = ":"
SPLIT_SEED = 20260109
"""Seed of the triple split (never a run seed: the splits must not move between runs)."""


DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
          "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
MAX_STEPS = 99
ANSWER_TOKENS = 5
"""``\\boxed{d}`` is 5 tokens: ``\\``, ``boxed``, ``{``, the digit, ``}``."""


def number_word(k: int) -> str:
    """``k`` in 0..99 spelt in CamelCase: 7 -> ``Seven``, 23 -> ``TwentyThree``."""
    if not 0 <= k <= MAX_STEPS:
        raise ValueError(f"number_word: {k} is outside 0..{MAX_STEPS}")
    if k < 10:
        return DIGIT_WORDS[k].capitalize()
    if k < 20:
        return _TEENS[k - 10].capitalize()
    return _TENS[k // 10].capitalize() + (DIGIT_WORDS[k % 10].capitalize() if k % 10 else "")


def digit_word(d: int) -> str:
    """A chain state: ``seven``."""
    return DIGIT_WORDS[d]


def step_word(k: int) -> str:
    """The marker of step k: ``sOne``, ``sTwentyThree``."""
    return "s" + number_word(k)


def tag_word(letter: str, d: int) -> str:
    """A prompt tag: ``aSeven`` (letter a, value 7)."""
    return letter + number_word(d)


def answer_text(d: int) -> str:
    return f"\\boxed{{{d}}}"


@dataclass(frozen=True)
class Problem:
    """One chain: start ``x0``, map ``x <- (a x + b) mod 10``, and its distractor tags."""

    x0: int
    a: int
    b: int
    distractors: tuple[tuple[str, int], ...] = ()
    """``(letter, digit)`` of each distractor tag."""
    order: tuple[int, ...] = ()
    """Position of each tag in the prompt: index into ``(x, a, b, *distractors)``; empty = that order."""

    @property
    def key(self) -> tuple[int, int, int]:
        """What the answer depends on; the split is made on it."""
        return (self.x0, self.a, self.b)

    def states(self, steps: int) -> list[int]:
        """``[x1, ..., xN]``."""
        out, x = [], self.x0
        for _ in range(steps):
            x = (self.a * x + self.b) % MODULUS
            out.append(x)
        return out

    def prompt(self) -> str:
        tags = [tag_word("x", self.x0), tag_word("a", self.a), tag_word("b", self.b)]
        tags += [tag_word(letter, d) for letter, d in self.distractors]
        order = self.order or tuple(range(len(tags)))
        return " ".join([PROMPT_START, *(tags[i] for i in order), PROMPT_END])

    def solution(self, steps: int) -> str:
        states = self.states(steps)
        words = [w for k, x in enumerate(states, start=1) for w in (step_word(k), digit_word(x))]
        return " ".join(words + [answer_text(states[-1])])

    def answer(self, steps: int) -> str:
        return str(self.states(steps)[-1])


def all_keys() -> list[tuple[int, int, int]]:
    return [(x0, a, b) for x0 in range(MODULUS) for a in MULTIPLIERS for b in range(MODULUS)]


def split_keys(heldout_size: int) -> dict[str, list[tuple[int, int, int]]]:
    """The fixed split of the 400 ``(x0, a, b)`` triples: ``heldout_size`` held out, the rest for training."""
    keys = all_keys()
    if not 0 < heldout_size < len(keys):
        raise ValueError(f"modchain heldout_size must be in [1, {len(keys) - 1}], got {heldout_size}")
    random.Random(SPLIT_SEED).shuffle(keys)
    return {"heldout": sorted(keys[:heldout_size]), "train": sorted(keys[heldout_size:])}


def make_problem(key: tuple[int, int, int], distractors: int, rng: random.Random) -> Problem:
    """``key`` with ``distractors`` distractor tags (distinct letters) and a random tag order drawn from ``rng``."""
    if not 0 <= distractors <= len(DISTRACTOR_LETTERS):
        raise ValueError(f"modchain distractors must be in [0, {len(DISTRACTOR_LETTERS)}], got {distractors}")
    letters = rng.sample(DISTRACTOR_LETTERS, distractors)
    extra = tuple((letter, rng.randrange(MODULUS)) for letter in letters)
    order = list(range(len(PARAM_LETTERS) + distractors))
    rng.shuffle(order)
    return Problem(*key, distractors=extra, order=tuple(order))


def vocabulary(steps: int) -> list[str]:
    """Every word (one token each) a prompt or a solution of an N-step chain contains, in a fixed order; the
    answers ``\\boxed{d}`` are several tokens (``answer_text``)."""
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"modchain steps must be in [1, {MAX_STEPS}], got {steps}")
    tags = [tag_word(letter, d) for letter in (*PARAM_LETTERS, *DISTRACTOR_LETTERS) for d in range(MODULUS)]
    return [PROMPT_START, PROMPT_END, *DIGIT_WORDS, *tags, *(step_word(k) for k in range(1, steps + 1))]
