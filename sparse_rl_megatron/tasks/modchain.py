"""``modchain``: a multi-step task on which Sparse-RL GRPO runs in minutes on a CPU (the embedded default).

Iterate ``x <- (a x + b) mod M`` from ``x0`` for N steps (``modchain_problems.py``: formats and split). The
parameters are tags among distractors in a short prompt, and the chain of thought (2N + 1 words + EOS) is
several times longer than a small KV budget, so a compressed cache must keep the few prompt tags that every
step needs while it evicts the rest. The model is a tiny standard HF Qwen2 with a word-level tokenizer built
in code; the warm start is a short supervised stage on worked solutions (``sft.py``).
See docs/embedded-default.md for the recommended settings and measured curves. ``trivial_answers`` gives the
shortcut audit (``tasks/audit.py``) its policies; records carry ``extra["shortcut_free"]``: the answer is none of
the values named in the prompt (evaluation reports the accuracy on those records apart), and ``extra["chain"]``,
the worked chain without its answer (evaluation reports the share of fully correct chains, ``eval/subsets.py``).
"""
from __future__ import annotations

import functools
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from sparse_rl_megatron.data.loader import Dataset
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.tasks.base import SPLITS, Task
from sparse_rl_megatron.tasks.modchain_problems import (
    DISTRACTOR_LETTERS, ChainFamily, answer_text, answer_tokens, answer_value, chain_words, check_answer_format, make_problem,
    parse_prompt, split_keys, vocabulary,
)
from sparse_rl_megatron.tasks.modchain_teacher import EarlyStopTeacher
from sparse_rl_megatron.tasks.sft import SFTConfig, StopCheck, check_output_free, save_model_dir, supervised_finetune
from sparse_rl_megatron.tasks.warm_check import WarmStartExpectations
from sparse_rl_megatron.tasks.word_tokenizer import build_word_tokenizer
from sparse_rl_megatron.models.tiny import tiny_config
from sparse_rl_megatron.utils.config_io import from_dict

NAME = "modchain"
WARM_START = {"steps": 300, "lr": 3e-3, "batch_size": 16, "decay_fraction": 0.4, "key_dropout": 0.9,
              "key_dropout_keep_recent": 4}
"""The recommended supervised stage (``SFTConfig`` fields; docs/embedded-default.md): about 50% held-out, and
response-key dropout so the model tolerates a compressed chain-of-thought cache. Options override these."""
MIN_POSITIONS = 256
"""Smallest ``max_position_embeddings`` (room for overlong sampled responses; RoPE has no parameters)."""


@dataclass(frozen=True)
class ModChainModel:
    """The tiny Qwen2 the task trains (standard HF architecture, tied embeddings)."""

    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Decoder layers (2 learn this task faster than 4 at half the cost per step: measured, docs)."""
    num_heads: int = 4
    """Query heads (head dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """KV heads (GQA groups)."""
    intermediate_size: int = 512
    """FFN width."""


def save_word_model(tokenizer, model: ModChainModel, sequence_tokens: int, out_dir: str | os.PathLike,
                    seed: int) -> Path:
    """A tiny Qwen2 of shape ``model`` over the word-level ``tokenizer``, initialised from ``seed``, written with the
    tokenizer to ``out_dir`` (positions for twice ``sequence_tokens``, prompt and response, at least
    ``MIN_POSITIONS``). The model of every chain task (``modchain``, ``lagchain``)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen2", vocab_size=len(tokenizer), hidden_size=model.hidden_size,
                         num_layers=model.num_layers, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                         intermediate_size=model.intermediate_size, tie_word_embeddings=True,
                         max_position_embeddings=max(MIN_POSITIONS, 2 * sequence_tokens))
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, tokenizer.eos_token_id, tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer.save_pretrained(tok_dir)
        return save_model_dir(built, tok_dir, out_dir)


def encode_demonstrations(task_name: str, records, tokenizer) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, demonstration_ids + [eos])`` of each of ``records`` (the teacher's demonstration, by default
    the worked solution, encoded after the prompt and a space, as the model continues the prompt)."""
    out = []
    for r in records:
        prompt = tokenizer(r.prompt, add_special_tokens=False)["input_ids"]
        shown = r.extra.get("demonstration", r.extra["solution"])
        full = tokenizer(f"{r.prompt} {shown}", add_special_tokens=False)["input_ids"]
        if full[:len(prompt)] != prompt:
            raise ValueError(f"{task_name}: the prompt of {r.source_id} does not tokenize as a prefix")
        out.append((prompt, full[len(prompt):] + [tokenizer.eos_token_id]))
    return out


def boxed_answer_starts(tokenizer, examples: list[tuple[list[int], list[int]]]) -> list[int]:
    """Where each example's boxed answer starts in its response (its last ``\\`` token); a demonstration without
    an answer (a weaker teacher's early stop): its response length."""
    box = tokenizer(" " + answer_text(0), add_special_tokens=False)["input_ids"][0]
    return [max((i for i, t in enumerate(response) if t == box), default=len(response)) for _, response in examples]


@dataclass(frozen=True)
class ModChainSpec:
    """Problem family and model of one ``modchain`` variant."""

    steps: int = 30
    """N: chain length; the response is 2N + 1 words plus EOS."""
    distractors: int = 4
    """Distractor tags in the prompt (the prompt is 5 + distractors tokens)."""
    family: ChainFamily = field(default_factory=ChainFamily)
    """Which ``(x0, a, b)`` triples exist (default: the 400 mod-10 chains)."""
    heldout_size: int = 100
    """``(x0, a, b)`` triples held out (of the family's); the other triples are the training problems."""
    heldout_variants: int = 4
    """Held-out records per held-out triple (different distractors and tag orders): 400 problems, so a
    greedy accuracy has a standard error of about 2.5 points."""
    train_variants: int = 10
    """Training records per training triple."""
    model: ModChainModel = field(default_factory=ModChainModel)
    """The model recipe."""
    teacher: EarlyStopTeacher | None = None
    """None: perfect demonstrations; else the weaker teacher of ``modchain_teacher.py`` (records then carry
    ``extra["subset"]`` and evaluation reports accuracy per class)."""
    restate_start: bool = False
    """Responses (solutions, demonstrations) open with ``sZero <x0>`` (2 more tokens), so every step adds one prompt
    value to the state just written (``modchain_problems.chain_words``); without it x1 = x0 + a needs two prompt
    values at once, the one step some warm starts never learn (docs/embedded-default.md, seed 2)."""
    answer_format: str = "digits"
    """How the final answer is boxed (``modchain_problems.ANSWER_FORMATS``): ``digits`` ``\\boxed{23}``, or ``word``
    ``\\boxed{ twentythree }``, a copy of the last state's token (no word-to-digits lookup to learn or unlearn)."""
    warm_start_steps: int = 300
    """Optimizer steps of the recommended supervised stage (``WARM_START``'s other fields apply); a config's
    ``warm_start.steps`` overrides it."""
    warm_start: Mapping[str, Any] = field(default_factory=dict)
    """This variant's changes to ``WARM_START`` (``SFTConfig`` fields); a config's ``warm_start`` overrides them."""
    warm_check: WarmStartExpectations | None = None
    """What this variant's warm start must do (``tasks/warm_check.py``; checked by the trainer); None: unchecked."""

    def __post_init__(self) -> None:
        for name in ("steps", "heldout_variants", "train_variants", "warm_start_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModChainSpec.{name} must be >= 1, got {getattr(self, name)}")
        check_answer_format(self.answer_format, "ModChainSpec.answer_format")
        split_keys(self.heldout_size, self.family)  # validates heldout_size
        make_problem((0, 1, 0), self.distractors, random.Random(0))  # validates distractors
        if self.teacher is not None:
            self.teacher.check_early_answers_wrong(self.steps, [self.family.problem(k) for k in self.family.keys()])


class ModChainTask(Task):
    """``task:modchain`` (see module docstring)."""

    description = "x <- (a*x + b) mod M for N steps from tags in the prompt; answer \\boxed{x_N}"
    template = "raw"
    reward = "exact"

    def __init__(self, spec: ModChainSpec | None = None, name: str = NAME):
        self.spec = spec or ModChainSpec()
        self.name = name
        self.warm_expectations = self.spec.warm_check

    # ----------------------------------------------------------------------------------------- problems
    @property
    def prompt_tokens(self) -> int:
        """Tokens of every prompt."""
        return 5 + self.spec.distractors

    @property
    def response_tokens(self) -> int:
        """Tokens of a correct response, EOS included (the least ``max_new_tokens`` that lets it finish)."""
        spec = self.spec
        return 2 * (spec.steps + spec.restate_start) + answer_tokens(spec.family.modulus, spec.answer_format) + 1

    def records(self, split: str, limit: int | None = None, seed: int = 0) -> Dataset:
        """Held-out: every held-out triple ``heldout_variants`` times, in a fixed order; train: every training
        triple ``train_variants`` times, shuffled. Distractors and tag order are drawn from ``seed``."""
        if split not in SPLITS:
            raise ValueError(f"{self.name} split must be one of {', '.join(SPLITS)}, got '{split}'")
        spec = self.spec
        keys = split_keys(spec.heldout_size, spec.family)[split]
        variants = spec.heldout_variants if split == "heldout" else spec.train_variants
        rng = random.Random(f"{self.name}/{split}/{seed}")
        modulus = spec.family.modulus
        rows = [(v, key, make_problem(key, spec.distractors, rng, modulus, spec.family.rule))
                for v in range(variants) for key in keys]
        if split == "train":
            rng.shuffle(rows)
        sep = "" if modulus <= 10 else "_"  # mod 10 keeps its ids (train-123-v0); else train-12_3_4-v0
        fmt = spec.answer_format
        records = []
        for v, (x0, a, b), p in rows[:limit]:
            answer = p.answer(spec.steps, fmt)
            free = all(answer_value(value, fmt) != answer for _, value in parse_prompt(p.prompt()))
            records.append(MathRecord(
                prompt=p.prompt(), answer=answer, source_id=f"{split}-{x0}{sep}{a}{sep}{b}-v{v}", dataset=self.name,
                answer_style="boxed",
                extra={"solution": p.solution(spec.steps, spec.restate_start, fmt), "x0": x0, "a": a, "b": b,
                       "shortcut_free": free,
                       "chain": " ".join(chain_words(x0, p.states(spec.steps), spec.restate_start))}))
        if spec.teacher is not None:  # the demonstrations: one draw per record, in record order
            teacher_rng = random.Random(f"{self.name}/teacher/{split}/{seed}")
            for r, (_, key, p) in zip(records, rows):
                r.extra["subset"] = spec.teacher.subset_of(p, spec.steps)
                r.extra["demonstration"] = spec.teacher.demonstration(p, spec.steps, teacher_rng, spec.restate_start,
                                                                      fmt)
        return Dataset(name=self.name, path=f"task:{self.name}/{split}", records=records)

    # -------------------------------------------------------------------------------------------- model
    def tokenizer(self):
        """The word-level tokenizer of this variant's vocabulary."""
        spec = self.spec
        modulus = spec.family.modulus
        return build_word_tokenizer(vocabulary(spec.steps, modulus, spec.restate_start),
                                    [" " + answer_text(d, spec.answer_format) for d in range(modulus)])

    # ------------------------------------------------------------------------------------------ shortcuts
    def trivial_answers(self, record: MathRecord) -> dict[str, str | None]:
        """The answers of the trivial policies this task makes tempting (``tasks/audit.py``), named ``group: policy``:
        each value read off the prompt (the start x0, each tag by letter and by position), and stopping the chain
        after step k for every 0 < k < N. None: no answer for this prompt (the tag's letter is absent)."""
        tags = parse_prompt(record.prompt)
        by_letter = dict(tags)
        out: dict[str, str | None] = {}
        problem = self.spec.family.problem((record.extra["x0"], record.extra["a"], record.extra["b"]))
        boxed = functools.partial(answer_value, answer_format=self.spec.answer_format)  # as the box holds it
        out["prompt: the start x0"] = boxed(problem.x0)
        for letter in ("a", "b", *DISTRACTOR_LETTERS):
            out[f"prompt: tag {letter}"] = boxed(by_letter[letter]) if letter in by_letter else None
        for i, (_, value) in enumerate(tags):
            out[f"prompt: tag #{i + 1}"] = boxed(value)
        for k, x in enumerate(problem.states(self.spec.steps - 1), start=1):
            out[f"early stop: x_{k}"] = boxed(x)
        return out

    def build_model(self, out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
        return save_word_model(self.tokenizer(), self.spec.model, self.prompt_tokens + self.response_tokens, out_dir,
                               seed)

    # --------------------------------------------------------------------------------------- warm start
    def sft_examples(self, tokenizer, seed: int = 0) -> list[tuple[list[int], list[int]]]:
        """``(prompt_ids, demonstration_ids + [eos])`` of every training record (the teacher's demonstration, by
        default the worked solution, encoded after the prompt and a space, as the model continues the prompt)."""
        return encode_demonstrations(self.name, self.records("train", seed=seed), tokenizer)

    def answer_starts(self, tokenizer, examples: list[tuple[list[int], list[int]]]) -> list[int]:
        """Where each example's boxed answer starts in its response (its last ``\\`` token): the key before it is
        the state the answer copies (``SFTConfig.key_dropout_answer_anchor``); a demonstration that stops without an
        answer (the weaker teacher's early stop) has none: its response length."""
        return boxed_answer_starts(tokenizer, examples)

    def warm_start(self, model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0,
                   should_stop: StopCheck | None = None, **options: Any) -> dict[str, float]:
        """Supervised stage on the training problems' worked solutions: ``SFTConfig`` fields as options (defaults
        ``WARM_START`` with the spec's ``warm_start_steps`` and ``warm_start``), plus ``eval_problems``: held-out problems scored greedily at the end (0 = skip). Works
        from any checkpoint of this task, so it also serves as the equal-time supervised control."""
        from transformers import AutoTokenizer

        eval_problems = int(options.pop("eval_problems", 200))
        config = from_dict(SFTConfig, {**WARM_START, "steps": self.spec.warm_start_steps, **self.spec.warm_start,
                                       **options}, "warm_start")
        check_output_free(out_dir)
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        examples = self.sft_examples(tok, seed)
        metrics = supervised_finetune(model_dir, out_dir, examples, config, seed=seed,
                                      answer_starts=self.answer_starts(tok, examples), should_stop=should_stop)
        if eval_problems > 0:
            from sparse_rl_megatron.tasks.accuracy import heldout_accuracy

            metrics[MN.SFT_HELDOUT_ACC] = heldout_accuracy(self, out_dir, limit=eval_problems, seed=seed)
        return metrics
