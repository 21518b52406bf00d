"""Problems of the ``modchain`` task: iterate ``x <- (a * x + b) mod M`` from ``x0`` for N steps (M = 10 by default).

Text formats: words separated by single spaces, each word one token (``word_tokenizer.py``; under Qwen2's
pre-tokenizer a token cannot mix letters and digits, so numbers inside words are spelt out):

- prompt: ``Q`` then the tags of ``x0``, ``a``, ``b`` and D distractor tags (other letters, random digits) in a
  random order, then ``:``. E.g. ``Q cFour aSeven eOne xThree fZero bTwo dNine :`` (x0 = 3, a = 7, b = 2).
  A tag is one token (letter and digit merged), so the parameters are a few salient prompt tokens that any
  step can attend to by content.
- worked solution (chain of thought, then the final answer): ``sOne <x1> sTwo <x2> ... sThirty <xN> \\boxed{xN}``
  with the states as number words (``seven``, ``twentythree``) and the answer in one of ``ANSWER_FORMATS``:
  ``digits`` (``sOne three sTwo six ... sThirty four \\boxed{4}``: the box transliterates the last state's word
  into digit tokens) or ``word`` (``... sThirty four \\boxed{ four }``: the box copies the last state's token).
  A response is 2N words plus the answer's tokens (``\\``, ``boxed``, ``{``, one token per digit or the state's
  word, ``}``) plus EOS.

Every step needs the previous state (local) and ``a``, ``b`` from the prompt, and errors compound over the
N steps. The answer depends only on ``(x0, a, b)``; a ``ChainFamily`` says which triples exist (by default
10 x 4 x 10 = 400 problems, mod 10). The split is made on these triples with a fixed seed (``SPLIT_SEED``),
independent of any run seed, so train and held-out problems can never be the same problem, whatever the
distractors.

The mod-10 family has a shortcut (``tasks/audit.py``, docs/embedded-default.md): every period of its maps
divides 20, so with N = 30 the answer x_30 is x_10, and it equals the start x0 on 62% of the problems. The
shortcut-free families have periods longer than N: ``alternating`` offsets mod 31 (two steps add a + b: a state
returns at an even lag after 62 steps, at odd lags by coincidence; what the 2-layer model learns), or affine mod 100 with multipliers 1 mod 20 and unit offsets
(periods 100).
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from math import gcd

MODULUS = 10
"""The default family's modulus."""
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
MAX_MODULUS = 100
"""States and tag values are spelt with ``number_word`` (0..99)."""
ANSWER_TOKENS = 5
"""``\\boxed{d}`` is 5 tokens: ``\\``, ``boxed``, ``{``, the digit, ``}`` (one more per extra digit)."""
ANSWER_FORMATS = ("digits", "word")
"""How the final answer x_N is boxed: ``digits`` ``\\boxed{23}`` (a lookup from the state's word to its digit
tokens, which a warm start learns entry by entry and RL can overwrite entry by entry: docs/embedded-default.md,
"Every draw"), or ``word`` ``\\boxed{ twentythree }`` (the same token as the state written just before: a copy)."""

Key = tuple[int, int, int]
RULES = ("affine", "alternating")
"""The maps of a chain (``Problem.rule``)."""


def check_answer_format(answer_format: str, field: str = "answer_format") -> None:
    """Raise ``ValueError`` naming ``field`` and the valid formats unless ``answer_format`` is one of them."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"{field} must be one of {', '.join(ANSWER_FORMATS)}, got '{answer_format}'")


def answer_tokens(modulus: int, answer_format: str = "digits") -> int:
    """Tokens of the longest answer: ``\\boxed{M-1}`` (digits are one token each under Qwen2's pre-tokenizer) or
    ``\\boxed{ <word> }`` (the word is one token)."""
    check_answer_format(answer_format)
    return ANSWER_TOKENS - 1 + (len(str(modulus - 1)) if answer_format == "digits" else 1)


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
    """A chain state: ``seven``, ``twentythree`` (for d < 10 the words of ``DIGIT_WORDS``)."""
    return number_word(d).lower()


def chain_words(x0: int, states: list[int], restate_start: bool = False) -> list[str]:
    """``sOne <x1> sTwo <x2> ...`` of ``states`` (= ``[x1, x2, ...]``); ``restate_start``: preceded by ``sZero <x0>``,
    so that every step adds one prompt value to the state just written. Without it the first state x1 = x0 + a
    is the only one that needs two prompt values at once, and it is where warm starts fail: on seed 2 of the
    embedded default 352 of the 400 held-out chains went wrong at step 1 and at no later step (docs/embedded-default.md)."""
    start = [step_word(0), digit_word(x0)] if restate_start else []
    return start + [w for k, x in enumerate(states, start=1) for w in (step_word(k), digit_word(x))]


def step_word(k: int) -> str:
    """The marker of step k: ``sOne``, ``sTwentyThree``."""
    return "s" + number_word(k)


def tag_word(letter: str, d: int) -> str:
    """A prompt tag: ``aSeven`` (letter a, value 7)."""
    return letter + number_word(d)


def answer_value(d: int, answer_format: str = "digits") -> str:
    """What the box of state ``d`` holds, the gold answer: ``23`` or ``twentythree``."""
    check_answer_format(answer_format)
    return str(d) if answer_format == "digits" else digit_word(d)


def answer_text(d: int, answer_format: str = "digits") -> str:
    """The boxed answer of state ``d``: ``\\boxed{23}`` or ``\\boxed{ twentythree }`` (spaces around the word, so that
    it is the state's own token `` twentythree`` and the closing brace is `` }``)."""
    value = answer_value(d, answer_format)
    return f"\\boxed{{{value}}}" if answer_format == "digits" else f"\\boxed{{ {value} }}"


_NUMBER_WORDS = {number_word(k): k for k in range(MAX_STEPS + 1)}


def parse_prompt(prompt: str) -> list[tuple[str, int]]:
    """``(letter, value)`` of each tag of a prompt, in prompt order: ``Q aSeven xThree :`` -> a 7, x 3."""
    words = prompt.split()
    if len(words) < 2 or words[0] != PROMPT_START or words[-1] != PROMPT_END:
        raise ValueError(f"not a modchain prompt: {prompt!r}")
    return [(w[0], _NUMBER_WORDS[w[1:]]) for w in words[1:-1]]


@dataclass(frozen=True)
class Problem:
    """One chain: start ``x0``, map ``x <- (a x + b) mod modulus``, and its distractor tags."""

    x0: int
    a: int
    b: int
    distractors: tuple[tuple[str, int], ...] = ()
    """``(letter, digit)`` of each distractor tag."""
    order: tuple[int, ...] = ()
    """Position of each tag in the prompt: index into ``(x, a, b, *distractors)``; empty = that order."""
    modulus: int = MODULUS
    """M of ``x <- (a x + b) mod M``."""
    rule: str = "affine"
    """``affine``: x <- (a x + b) mod M every step; ``alternating``: x <- (x + a) mod M on odd steps and
    (x + b) mod M on even ones (``RULES``)."""

    @property
    def key(self) -> tuple[int, int, int]:
        """What the answer depends on; the split is made on it."""
        return (self.x0, self.a, self.b)

    def states(self, steps: int) -> list[int]:
        """``[x1, ..., xN]``."""
        out, x = [], self.x0
        for k in range(1, steps + 1):
            if self.rule == "alternating":
                x = (x + (self.a if k % 2 else self.b)) % self.modulus
            else:
                x = (self.a * x + self.b) % self.modulus
            out.append(x)
        return out

    def prompt(self) -> str:
        tags = [tag_word("x", self.x0), tag_word("a", self.a), tag_word("b", self.b)]
        tags += [tag_word(letter, d) for letter, d in self.distractors]
        order = self.order or tuple(range(len(tags)))
        return " ".join([PROMPT_START, *(tags[i] for i in order), PROMPT_END])

    def solution(self, steps: int, restate_start: bool = False, answer_format: str = "digits") -> str:
        """The worked solution; ``restate_start``: it opens with ``sZero <x0>`` (``chain_words``); the box in
        ``answer_format`` (``ANSWER_FORMATS``)."""
        states = self.states(steps)
        return " ".join(chain_words(self.x0, states, restate_start) + [answer_text(states[-1], answer_format)])

    def answer(self, steps: int, answer_format: str = "digits") -> str:
        """The gold answer: what the box of x_N holds."""
        return answer_value(self.states(steps)[-1], answer_format)


@dataclass(frozen=True)
class ChainFamily:
    """Which ``(x0, a, b)`` triples a variant's problems are: x0 in 0..M-1, a in ``multipliers``, b in ``offsets``."""

    rule: str = "affine"
    """The map (``Problem.rule``): ``affine`` (a a unit multiplier) or ``alternating`` (a and b both offsets, added
    on odd and even steps: one addition per step, which a small model learns more easily than a product mod M)."""

    modulus: int = MODULUS
    """M (2..100)."""
    multipliers: tuple[int, ...] = MULTIPLIERS
    """The values of a (units mod M, so the map is a bijection)."""
    offsets: tuple[int, ...] | None = None
    """The values of b; None: every residue."""
    skip_fixed_points: bool = False
    """Leave out the starts with a x0 + b = x0 (mod M): their chains are constant, so x0 is the answer."""

    def __post_init__(self) -> None:
        if not 2 <= self.modulus <= MAX_MODULUS:
            raise ValueError(f"ChainFamily.modulus must be in [2, {MAX_MODULUS}], got {self.modulus}")
        if self.rule not in RULES:
            raise ValueError(f"ChainFamily.rule must be one of {', '.join(RULES)}, got '{self.rule}'")
        unit = self.rule == "affine"  # an alternating chain's a is an offset
        bad = [a for a in self.multipliers if not 0 < a < self.modulus or (unit and gcd(a, self.modulus) != 1)]
        if bad or not self.multipliers:
            raise ValueError(f"ChainFamily.multipliers must be units mod {self.modulus}, got {self.multipliers}")
        if self.offsets is not None and (not self.offsets or any(not 0 <= b < self.modulus for b in self.offsets)):
            raise ValueError(f"ChainFamily.offsets must be residues mod {self.modulus}, got {self.offsets}")

    def keys(self) -> list[Key]:
        """Every triple of the family, sorted (a new list each call; computed once per family)."""
        return list(self._keys)

    @functools.cached_property
    def _keys(self) -> tuple[Key, ...]:
        m = self.modulus
        offsets = range(m) if self.offsets is None else self.offsets
        return tuple((x0, a, b) for x0 in range(m) for a in self.multipliers for b in offsets
                     if not (self.skip_fixed_points and self.problem((x0, a, b)).states(1)[0] == x0))

    def problem(self, key: Key) -> Problem:
        """The chain of ``key`` (no distractors)."""
        return Problem(*key, modulus=self.modulus, rule=self.rule)


DEFAULT_FAMILY = ChainFamily()
"""Mod 10, a in {1, 3, 7, 9}, every b: the 400 problems of ``modchain`` and ``modchain_weak``."""


def all_keys(family: ChainFamily = DEFAULT_FAMILY) -> list[Key]:
    return family.keys()


def split_keys(heldout_size: int, family: ChainFamily = DEFAULT_FAMILY) -> dict[str, list[Key]]:
    """The fixed split of the family's ``(x0, a, b)`` triples: ``heldout_size`` held out, the rest for training."""
    keys = family.keys()
    if not 0 < heldout_size < len(keys):
        raise ValueError(f"modchain heldout_size must be in [1, {len(keys) - 1}], got {heldout_size}")
    random.Random(SPLIT_SEED).shuffle(keys)
    return {"heldout": sorted(keys[:heldout_size]), "train": sorted(keys[heldout_size:])}


def make_problem(key: Key, distractors: int, rng: random.Random, modulus: int = MODULUS,
                 rule: str = "affine") -> Problem:
    """``key`` with ``distractors`` distractor tags (distinct letters) and a random tag order drawn from ``rng``."""
    if not 0 <= distractors <= len(DISTRACTOR_LETTERS):
        raise ValueError(f"modchain distractors must be in [0, {len(DISTRACTOR_LETTERS)}], got {distractors}")
    letters = rng.sample(DISTRACTOR_LETTERS, distractors)
    extra = tuple((letter, rng.randrange(modulus)) for letter in letters)
    order = list(range(len(PARAM_LETTERS) + distractors))
    rng.shuffle(order)
    return Problem(*key, distractors=extra, order=tuple(order), modulus=modulus, rule=rule)


def vocabulary(steps: int, modulus: int = MODULUS, restate_start: bool = False) -> list[str]:
    """Every word (one token each) a prompt or a solution of an N-step chain mod ``modulus`` contains, in a fixed
    order; the answers ``\\boxed{d}`` are several tokens (``answer_text``). ``restate_start``: ``sZero`` too (last,
    so the other words keep their ids)."""
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"modchain steps must be in [1, {MAX_STEPS}], got {steps}")
    states = [digit_word(d) for d in range(modulus)]
    tags = [tag_word(letter, d) for letter in (*PARAM_LETTERS, *DISTRACTOR_LETTERS) for d in range(modulus)]
    return [PROMPT_START, PROMPT_END, *states, *tags, *(step_word(k) for k in range(1, steps + 1)),
            *([step_word(0)] if restate_start else [])]
