"""``lagchain``: a chain whose every step reads the response itself, L steps back (issue 39: where compression bites).

On ``modchain`` every state is the previous state plus a prompt value, and the prompt is never evicted: a compressed
cache that keeps the last few tokens loses nothing, so no budget can make the sparse sampler differ from the dense
policy except where a compressor misfires. Here the response keeps L registers updated in turn: state k belongs to
register ``k mod L`` and is that register's previous value plus an increment from the prompt,

    x_k = (x_{k-L} + (a if k odd else b)) mod M        for k >= L,

with x_0 .. x_{L-1} restated from prompt tags (``sZero vSeven sOne wTwo ...``). The value a step needs was written
2L - 1 positions before its query, far beyond the last state; a compressed cache keeps the right tokens only if its
compressor keeps the last L register values (recency does; attention-based scorers see only where the current step
looks, not where the next ones will).

With one L for every problem (``lagchain31_weak``, L = 6) the reach-back is the same on every step of every problem,
so a budget either keeps every read or none: the measured curve is a cliff (docs/experiments.md). With ``lags``
(``lagchain31_var_weak``: L in 2..6, drawn per problem) the reach-back 2L - 1 varies between problems (3..11
positions) and the prompt tells L (tag ``lFour`` right after ``Q``), so the share of problems whose reads a recency
cache keeps grows with its budget.

Formats (words separated by single spaces, each one token; ``word_tokenizer.py``):

- prompt: ``Q`` (with ``lags``: then L's tag ``l<L>``), then the tags of x_0 .. x_{L-1} (letters ``c d e f g h``), of
  a and b, and D distractor tags (other letters, random values) in a random order, then ``:``;
- worked solution: ``sZero <v x_0> sOne <w x_1> ... sN <reg x_N> \\boxed{x_N}``, where a state is written with its
  register's letter (``vSeven``: register v holds 7; with ``register_letters = INITIAL_LETTERS`` the letter of its
  initial value's tag, ``dSeven``, so restating x_i copies the tag), so a step finds its register's last value by
  content; with ``register_tokens`` as two words (``sOne w seven``: the read is the value word after the register's
  last letter) and, with ``answer_format: word``, the box holds the last value word (``\\boxed{ seven }``).

The answer is x_N = x_{N mod L} + (rounds) x increment, a function of one initial value and one increment: no
prompt value, constant or early state gives it (``sparse-rl audit``). A weaker teacher (``modchain_teacher.py``'s
rule: where x_stop is odd, stop after step ``stop_step`` with probability 0.7, without an answer) leaves headroom for
RL.
"""
from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from sparse_rl_megatron.data.loader import Dataset
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.data.record_extras import CHAIN_KEY, SHORTCUT_FREE_KEY, SUBSET_KEY
from sparse_rl_megatron.tasks.base import SPLITS, Task
from sparse_rl_megatron.tasks.modchain import (
    WARM_START, ModChainModel, boxed_answer_starts, encode_demonstrations, save_word_model,
)
from sparse_rl_megatron.tasks.modchain_problems import (
    PROMPT_END, PROMPT_START, SPLIT_SEED, answer_text, answer_tokens, answer_value, check_answer_format, digit_word,
    number_word, parse_prompt, step_word,
)
from sparse_rl_megatron.tasks.modchain_teacher import OTHER
from sparse_rl_megatron.tasks.sft import SFTConfig, StopCheck, check_output_free, supervised_finetune
from sparse_rl_megatron.tasks.warm_check import WarmStartExpectations
from sparse_rl_megatron.tasks.word_tokenizer import build_word_tokenizer
from sparse_rl_megatron.utils.config_io import from_dict

INITIAL_LETTERS = "cdefgh"
"""Prompt tags of the initial values x_0 .. x_{L-1} (L <= 6)."""
INCREMENT_LETTERS = ("a", "b")
DISTRACTOR_LETTERS = "kmnpqr"
REGISTER_LETTERS = "vwxyzj"
"""The letter a state is written with: register ``k mod L``."""
CLASS = "odd_x_stop"
"""The weaker teacher's class (as ``modchain_teacher``'s): x_stop odd and not the answer."""

LAG_LETTER = "l"
"""Prompt tag of a problem's register count L where the problems' L varies (``lFour``: 4 registers)."""

Key = tuple[tuple[int, ...], int, int]
"""(initial values, a, b): what the answer depends on (L = the number of initial values); the split is made on it."""


@dataclass(frozen=True)
class LagChainSpec:
    """One ``lagchain`` variant: problem family, teacher and model."""

    lag: int = 6
    """L: registers, so a step reads the state written L steps (2L - 1 positions before its query); with ``lags``,
    the largest of them."""
    lags: tuple[int, ...] = ()
    """Register counts drawn per problem (uniformly), so the reach-back 2L - 1 varies between problems; the prompt
    tells L (tag ``l<L>`` after ``Q``, and the initial values' tags). Empty: every problem has ``lag``, untold."""
    modulus: int = 31
    """M."""
    steps: int = 29
    """N: the last state (x_0 .. x_N are written)."""
    increments: tuple[int, ...] = tuple(range(1, 10))
    """The values of a and b."""
    problems: int = 4000
    """Triples drawn for the family (held-out + training), distinct."""
    heldout_size: int = 400
    """Of them held out (one record each); the rest train (``train_variants`` records each)."""
    train_variants: int = 1
    """Training records per training problem (other distractors and tag orders)."""
    distractors: int = 2
    """Distractor tags in the prompt."""
    stop_step: int = 26
    """The weaker teacher's early stop (no answer after it), on its class with probability ``stop_prob``."""
    stop_prob: float = 0.7
    register_tokens: bool = False
    """Write a state as two tokens, its register's letter and its value's word (``w eight``), so that a step finds its
    register's last value as the word after the register's last letter (an induction: the value words are the 31
    of ``modchain``, shared by the registers); False: one token per state (``wEight``, 6 x 31 state tokens)."""
    register_marker: bool = False
    """Write each state after a bare marker, its register's letter (``sFive d dTwentyTwo``): the step first names the
    register (the successor of the last marker, wrapping at L), then its state token's read is the token after that
    marker's last occurrence, 3L - 1 back (an induction, the same for every L); False: the state token alone."""
    register_letters: str = REGISTER_LETTERS
    """The letters registers 0 .. L-1 are written with: ``REGISTER_LETTERS`` (their own), or ``INITIAL_LETTERS``, the
    tags of the initial values, so that register i's states are the same tokens as x_i's prompt tag (``dSeven``):
    restating x_i copies its tag, and a read finds its register's last value among tokens it shares with the
    prompt."""
    answer_format: str = "digits"
    """How the answer x_N is boxed (``modchain_problems.ANSWER_FORMATS``): ``digits`` ``\\boxed{12}`` or ``word``
    ``\\boxed{ twelve }`` (needs ``register_tokens``: a copy of the value word just written)."""
    model: ModChainModel = field(default_factory=ModChainModel)
    warm_start_steps: int = 1000
    warm_start: Mapping[str, Any] = field(default_factory=dict)
    """Changes to ``modchain.WARM_START`` (``SFTConfig`` fields)."""
    warm_check: WarmStartExpectations | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.lag <= len(INITIAL_LETTERS):
            raise ValueError(f"LagChainSpec.lag must be in [2, {len(INITIAL_LETTERS)}], got {self.lag}")
        if self.lags and (len(self.lags) < 2 or list(self.lags) != sorted(set(self.lags))
                          or not 2 <= self.lags[0] or self.lags[-1] != self.lag):
            raise ValueError(f"LagChainSpec.lags must be empty or at least 2 distinct increasing values in "
                             f"[2, lag], the last equal to lag = {self.lag}, got {self.lags}")
        if not self.lag <= self.stop_step < self.steps:
            raise ValueError(f"LagChainSpec.stop_step must be in [lag, steps), got {self.stop_step}")
        if not 0 < self.heldout_size < self.problems:
            raise ValueError(f"LagChainSpec.heldout_size must be in [1, problems), got {self.heldout_size}")
        if any(not 0 < i < self.modulus for i in self.increments):
            raise ValueError(f"LagChainSpec.increments must be in [1, modulus), got {self.increments}")
        if self.register_letters not in (REGISTER_LETTERS, INITIAL_LETTERS):
            raise ValueError(f"LagChainSpec.register_letters must be '{REGISTER_LETTERS}' (the registers' own) or "
                             f"'{INITIAL_LETTERS}' (the initial values' tags), got '{self.register_letters}'")
        if self.register_marker and self.register_tokens:
            raise ValueError("LagChainSpec.register_marker and register_tokens are two ways to write a state: set one")
        check_answer_format(self.answer_format, "LagChainSpec.answer_format")
        if self.answer_format == "word" and not self.register_tokens:
            raise ValueError("LagChainSpec.answer_format 'word' needs register_tokens=True (the box copies a value "
                             "word, which a one-token state does not write)")

    @property
    def tokens_per_step(self) -> int:
        """The step word and the state: 2 tokens, or 3 with a register marker or a letter + value word state."""
        return 3 if self.register_tokens or self.register_marker else 2

    @property
    def told(self) -> bool:
        """The problems' L varies, so the prompt tells it."""
        return bool(self.lags)


def lag_of(key: Key) -> int:
    """A problem's register count L."""
    return len(key[0])


def read_offset(lag: int, register_tokens: bool = False) -> int:
    """How far before its query a step's read lies: the state of its register, written L steps back (2 tokens a
    step: 2L - 1; with ``register_tokens`` 3 tokens a step, the query the register's letter: 3L - 1)."""
    return (3 if register_tokens else 2) * lag - 1


def states(key: Key, spec: LagChainSpec) -> list[int]:
    """``[x_0, ..., x_N]`` (L = ``lag_of(key)``)."""
    xs, lag = list(key[0]), lag_of(key)
    a, b = key[1], key[2]
    for k in range(lag, spec.steps + 1):
        xs.append((xs[k - lag] + (a if k % 2 else b)) % spec.modulus)
    return xs


def state_word(k: int, value: int, lag: int, spec: LagChainSpec) -> str:
    """State k as ``spec`` writes it: its register's letter (``spec.register_letters[k mod L]``) and the value, one
    token (``vSeven``), with ``register_tokens`` two words (``v seven``), with ``register_marker`` the letter then the
    token (``v vSeven``)."""
    letter = spec.register_letters[k % lag]
    if spec.register_tokens:
        return f"{letter} {digit_word(value)}"
    return f"{letter} {letter}{number_word(value)}" if spec.register_marker else letter + number_word(value)


def chain(xs: list[int], lag: int, last: int, spec: LagChainSpec) -> list[str]:
    """The words of ``sZero <x_0> ... s<last> <x_last>`` (a state one word or more: ``state_word``)."""
    return [w for k in range(last + 1) for w in (step_word(k), *state_word(k, xs[k], lag, spec).split())]


def record_key(record: MathRecord) -> Key:
    """The problem a record poses (its initial values and increments, from its extras)."""
    return tuple(record.extra["initial"]), record.extra["a"], record.extra["b"]


def in_class(xs: list[int], spec: LagChainSpec) -> bool:
    """The weaker teacher may stop early here: x_stop odd and not the answer."""
    return xs[spec.stop_step] % 2 == 1 and xs[spec.stop_step] != xs[spec.steps]


class LagChainTask(Task):
    """The ``lagchain31_*`` tasks (see the module docstring)."""

    description = "L registers updated in turn, each by a prompt increment, from the response L steps back"
    template = "raw"
    reward = "exact"

    def __init__(self, spec: LagChainSpec | None = None, name: str = "lagchain"):
        self.spec = spec or LagChainSpec()
        self.name = name
        self.warm_expectations = self.spec.warm_check

    @property
    def prompt_tokens(self) -> int:
        """The longest prompt (L = ``spec.lag``)."""
        return 2 + int(self.spec.told) + self.spec.lag + len(INCREMENT_LETTERS) + self.spec.distractors

    @property
    def response_tokens(self) -> int:
        spec = self.spec
        return spec.tokens_per_step * (spec.steps + 1) + answer_tokens(spec.modulus, spec.answer_format) + 1

    @functools.cached_property
    def _split(self) -> dict[str, list[Key]]:
        spec, rng = self.spec, random.Random(f"{SPLIT_SEED}/{self.name}")
        keys: set[Key] = set()
        while len(keys) < spec.problems:
            lag = rng.choice(spec.lags) if spec.told else spec.lag
            keys.add((tuple(rng.randrange(spec.modulus) for _ in range(lag)), rng.choice(spec.increments),
                      rng.choice(spec.increments)))
        ordered = sorted(keys)
        rng.shuffle(ordered)
        return {"heldout": sorted(ordered[:spec.heldout_size]), "train": sorted(ordered[spec.heldout_size:])}

    def _prompt(self, key: Key, rng: random.Random) -> tuple[str, list[tuple[str, int]]]:
        spec = self.spec
        tags = [(INITIAL_LETTERS[i], v) for i, v in enumerate(key[0])] + [("a", key[1]), ("b", key[2])]
        tags += [(letter, rng.randrange(spec.modulus)) for letter in rng.sample(DISTRACTOR_LETTERS, spec.distractors)]
        rng.shuffle(tags)
        if spec.told:
            tags.insert(0, (LAG_LETTER, lag_of(key)))
        return " ".join([PROMPT_START, *(letter + number_word(v) for letter, v in tags), PROMPT_END]), tags

    def records(self, split: str, limit: int | None = None, seed: int = 0) -> Dataset:
        """Held-out: each held-out problem once, in a fixed order; train: each training problem ``train_variants``
        times, shuffled. Distractors, tag order and the teacher's draws come from ``seed``."""
        if split not in SPLITS:
            raise ValueError(f"{self.name} split must be one of {', '.join(SPLITS)}, got '{split}'")
        spec = self.spec
        rng = random.Random(f"{self.name}/{split}/{seed}")
        variants = 1 if split == "heldout" else spec.train_variants
        rows = [(v, key) for v in range(variants) for key in self._split[split]]
        if split == "train":
            rng.shuffle(rows)
        teacher = random.Random(f"{self.name}/teacher/{split}/{seed}")
        out = []
        for v, key in rows[:limit]:
            prompt, tags = self._prompt(key, rng)
            xs, lag = states(key, spec), lag_of(key)
            answer = answer_value(xs[spec.steps], spec.answer_format)
            worked = chain(xs, lag, spec.steps, spec)
            solution = " ".join(worked + [answer_text(xs[spec.steps], spec.answer_format)])
            weak = in_class(xs, spec)
            stop = teacher.random() < spec.stop_prob  # drawn for every record: draws do not depend on the order
            shown = " ".join(chain(xs, lag, spec.stop_step, spec)) if weak and stop else solution  # no answer
            out.append(MathRecord(
                prompt=prompt, answer=answer, dataset=self.name, answer_style="boxed",
                source_id=f"{split}-{'_'.join(map(str, key[0]))}_{key[1]}_{key[2]}-v{v}",
                extra={"solution": solution, "demonstration": shown, "initial": list(key[0]), "a": key[1], "b": key[2],
                       SUBSET_KEY: CLASS if weak else OTHER, CHAIN_KEY: " ".join(worked),
                       SHORTCUT_FREE_KEY: all(value != xs[spec.steps] for _, value in tags)}))
        return Dataset(name=self.name, path=f"task:{self.name}/{split}", records=out)

    def trivial_answers(self, record: MathRecord) -> dict[str, str | None]:
        """Each value of the prompt (by letter and by position; L's tag too, where told) and stopping after step k for
        every k < N (None: the tag's letter is absent from this prompt)."""
        tags = parse_prompt(record.prompt)
        by_letter = dict(tags)
        boxed = functools.partial(answer_value, answer_format=self.spec.answer_format)  # as the box holds it
        out: dict[str, str | None] = {}
        told = (LAG_LETTER,) if self.spec.told else ()
        for letter in (*told, *INITIAL_LETTERS[:self.spec.lag], *INCREMENT_LETTERS, *DISTRACTOR_LETTERS):
            out[f"prompt: tag {letter}"] = boxed(by_letter[letter]) if letter in by_letter else None
        for i, (_, value) in enumerate(tags):
            out[f"prompt: tag #{i + 1}"] = boxed(value)
        for k, x in enumerate(states(record_key(record), self.spec)[:self.spec.steps]):
            out[f"early stop: x_{k}"] = boxed(x)
        return out

    # -------------------------------------------------------------------------------------------- model
    def tokenizer(self):
        spec = self.spec
        # one-token states are letter + value like the prompt's tags; with register_tokens a letter and a value word
        own = spec.register_letters != INITIAL_LETTERS  # else the states are the initial tags' tokens
        states = spec.register_letters[:spec.lag] if own and not spec.register_tokens else ()
        letters = (*INITIAL_LETTERS[:spec.lag], *INCREMENT_LETTERS, *DISTRACTOR_LETTERS, *states)
        words = [PROMPT_START, PROMPT_END, *(letter + number_word(v) for letter in letters for v in range(spec.modulus)),
                 *(step_word(k) for k in range(spec.steps + 1)), *(LAG_LETTER + number_word(lag) for lag in spec.lags)]
        if spec.tokens_per_step == 3:  # a bare register letter before the value (a word, or the state token)
            words += [*spec.register_letters[:spec.lag]]
        if spec.register_tokens:
            words += [digit_word(v) for v in range(spec.modulus)]
        return build_word_tokenizer(words, [" " + answer_text(d, spec.answer_format) for d in range(spec.modulus)])

    def build_model(self, out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
        return save_word_model(self.tokenizer(), self.spec.model, self.prompt_tokens + self.response_tokens, out_dir,
                               seed)

    # --------------------------------------------------------------------------------------- warm start
    def sft_examples(self, tokenizer, seed: int = 0) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
        """``(prompt_ids, demonstration_ids + [eos])`` of every training record, and where each boxed answer
        starts in its response."""
        examples = encode_demonstrations(self.name, self.records("train", seed=seed), tokenizer)
        return examples, boxed_answer_starts(tokenizer, examples)

    def sft_read_offsets(self, seed: int = 0) -> list[tuple[int, ...]]:
        """Per training record (``sft_examples``' order): the distance of its steps' read (``read_offset``, L its
        own); with ``register_tokens`` also the register letter before the value read (3L), the key an induction
        matches."""
        regs = self.spec.tokens_per_step == 3  # the query is the register's letter (or marker), just written
        reads = (read_offset(len(r.extra["initial"]), regs) for r in self.records("train", seed=seed))
        return [(read, read + 1) if regs else (read,) for read in reads]

    def warm_start(self, model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0,
                   should_stop: StopCheck | None = None, **options: Any) -> dict[str, float]:
        """Supervised stage on the teacher's demonstrations (``SFTConfig`` fields as options over ``WARM_START``
        with the spec's steps and changes); each example's read, for its own L (``sft_read_offsets``: 2L - 1 positions
        back, 3L - 1 with ``register_tokens``), is never dropped."""
        from transformers import AutoTokenizer

        options.pop("eval_problems", None)  # the trainer's check scores the warm start
        defaults = {**WARM_START, "steps": self.spec.warm_start_steps, **self.spec.warm_start}
        config = from_dict(SFTConfig, {**defaults, **options}, "warm_start")
        check_output_free(out_dir)
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        examples, starts = self.sft_examples(tok, seed)
        return supervised_finetune(model_dir, out_dir, examples, config, seed=seed, answer_starts=starts,
                                   example_keep_offsets=self.sft_read_offsets(seed), should_stop=should_stop)
