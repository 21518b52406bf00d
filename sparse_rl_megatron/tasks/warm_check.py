"""Does a warm start do what its teacher taught? The check after the supervised stage.

A tiny model's supervised stage can miss one single-token skill while the loss looks almost done: on some seeds
and kernel paths the `modchain31_weak` warm start wrote every chain right but boxed a wrong second digit on up to
57% of them, or got the first state of the chain wrong on 88%, and RL does not repair either
(docs/embedded-default.md, "The lottery"). A task that knows what a good warm start does states it as
``WarmStartExpectations``; ``check_warm_start`` scores the model greedily (dense) on held-out records and names
every expectation it missed. The trainer acts on a miss (``trainer/runtime/model_dirs.py``: retry with the next
warm-start seed, then stop in one line).

What is measured, on the first ``problems`` held-out records:
- ``loss_last``: the supervised stage's mean loss over its last 10 steps;
- ``heldout_accuracy``: greedy accuracy on all of them (a weaker teacher's class is expected to fail);
- ``taught_accuracy`` / ``taught_full_chains``: on the records the teacher demonstrated in full (its perfectly taught
  class; every record of a task without a weaker teacher), the accuracy and the share whose every intermediate
  state is right;
- ``boxes_right``: among the responses that write the whole chain right, the share whose final answer is right;
- with the run's compressed KV cache (the rollouts' own), ``sparse_taught_accuracy``: the warm start must tolerate the
  cache it will sample with (a warm start that wrote every chain right densely lost the chain after the first
  compression on 95% of them on one seed);
- ``sampled_taught_accuracy``: the accuracy on the taught records of ``samples_per_problem`` responses each, drawn as
  the rollouts draw them (the run's temperature and compressed cache): what RL starts from. A warm start can be
  right greedily on every taught record and still too diffuse to sample them right: one such draw (54% sampled,
  against 87-96% for most) lost the taught chains under RL, from the first step on (docs/embedded-default.md).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

from sparse_rl_megatron.data.record_extras import CHAIN_KEY, SUBSET_KEY, full_chain
from sparse_rl_megatron.data.templates import render_prompt
from sparse_rl_megatron.rewards.registry import REWARDS
from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

if TYPE_CHECKING:
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.data.record import MathRecord

TAUGHT_CLASS = "rest"
"""The class a weaker teacher demonstrates in full (``modchain_teacher.OTHER``); records without a class are taught
in full too."""


class CheckedTask(Protocol):
    """What of a task the check reads (``tasks/base.py``'s ``Task``, which names its ``WarmStartExpectations``, so
    this module does not import it)."""

    name: str
    template: str
    reward: str

    @property
    def response_tokens(self) -> int: ...

    def records(self, split: str, limit: int | None = None, seed: int = 0) -> Sequence["MathRecord"]: ...


@dataclass(frozen=True)
class WarmStartExpectations:
    """What a good warm start of a task does; a model below any bound misses the check."""

    max_loss: float
    """Largest ``loss_last`` (mean supervised loss of the last 10 steps)."""
    min_taught_accuracy: float
    """Least greedy accuracy on the held-out records the teacher demonstrated in full."""
    min_taught_full_chains: float
    """Least share of those records whose greedy response writes every intermediate state right."""
    min_boxes_right: float
    """Least share of right final answers among the greedy responses that write the whole chain right."""
    min_sparse_taught_accuracy: float | None = None
    """Least greedy accuracy on the taught records with the run's compressed KV cache (None: not checked)."""
    min_sampled_taught_accuracy: float | None = None
    """Least accuracy on the taught records of responses sampled as the rollouts sample (None: not checked)."""
    samples_per_problem: int = 4
    """Responses sampled per taught record for ``sampled_taught_accuracy``."""
    problems: int = 200
    """Held-out records scored (greedy, dense cache)."""

    def __post_init__(self) -> None:
        if not self.max_loss > 0:
            raise ValueError(f"WarmStartExpectations.max_loss must be > 0, got {self.max_loss}")
        for name in ("min_taught_accuracy", "min_taught_full_chains", "min_boxes_right", "min_sparse_taught_accuracy",
                     "min_sampled_taught_accuracy"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"WarmStartExpectations.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.problems < 1:
            raise ValueError(f"WarmStartExpectations.problems must be >= 1, got {self.problems}")
        if self.samples_per_problem < 1:
            raise ValueError(f"WarmStartExpectations.samples_per_problem must be >= 1, got {self.samples_per_problem}")

    def judge(self, measured: Mapping[str, float]) -> list[str]:
        """What ``measured`` (``check_warm_start``'s values) missed, one phrase each; empty when all hold. A share
        over no records (nan: e.g. no response wrote the whole chain) misses a positive bound."""
        missed = []
        if not measured["loss_last"] <= self.max_loss:
            missed.append(f"supervised loss {measured['loss_last']:.4f} > {self.max_loss}")
        for key, bound, what in (("taught_accuracy", self.min_taught_accuracy, "accuracy on the taught records"),
                                 ("taught_full_chains", self.min_taught_full_chains, "full chains on the taught records"),
                                 ("boxes_right", self.min_boxes_right, "right answers on the full chains"),
                                 ("sparse_taught_accuracy", self.min_sparse_taught_accuracy,
                                  "accuracy on the taught records with the compressed cache"),
                                 ("sampled_taught_accuracy", self.min_sampled_taught_accuracy,
                                  "sampled accuracy on the taught records")):
            if bound is None or key not in measured:
                continue
            if bound > 0 and not measured[key] >= bound:
                missed.append(f"{what} {measured[key]:.3f} < {bound}")
        return missed


@dataclass(frozen=True)
class WarmStartCheck:
    """One warm start's check: what was measured, against what, and what missed."""

    measured: dict[str, float]
    expected: WarmStartExpectations
    missed: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.missed

    def summary(self) -> str:
        """One line: ``passed (...)`` or ``missed: <what>; <what>``."""
        m = self.measured
        sparse = f", with the compressed cache {m['sparse_taught_accuracy']:.3f}" if "sparse_taught_accuracy" in m else ""
        sampled = f", sampled {m['sampled_taught_accuracy']:.3f}" if "sampled_taught_accuracy" in m else ""
        values = (f"taught accuracy {m['taught_accuracy']:.3f}{sparse}{sampled}, "
                  f"full chains {m['taught_full_chains']:.3f}, "
                  f"right answers on full chains {m['boxes_right']:.3f}, loss {m['loss_last']:.4f}")
        return f"passed ({values})" if self.passed else f"missed: {'; '.join(self.missed)} ({values})"

    def to_json(self) -> dict:
        return {"passed": self.passed, "missed": list(self.missed), "measured": self.measured,
                "expected": asdict(self.expected)}


def check_warm_start(task: "CheckedTask", model_dir: str | os.PathLike, expected: WarmStartExpectations,
                     loss_last: float, seed: int = 0, compression: "CompressionConfig | None" = None,
                     temperature: float = 1.0) -> WarmStartCheck:
    """Score the model of ``model_dir`` greedily on the first ``expected.problems`` held-out records of ``task``
    (which must carry their worked chain, ``extra["chain"]``), with a dense cache and, when ``compression`` is a
    compressed one and ``expected.min_sparse_taught_accuracy`` is set, with that cache too; when
    ``expected.min_sampled_taught_accuracy`` is set, sample the taught records at ``temperature`` with the run's
    cache (``compression``; dense when None), the sampler seeded with ``seed``; judge it
    against ``expected``."""
    records = task.records("heldout", limit=expected.problems, seed=seed)
    if any(CHAIN_KEY not in r.extra for r in records):
        raise ValueError(f"check_warm_start: the held-out records of {task.name} carry no worked chain")
    measured = chain_measures(records, *_respond(task, model_dir, records, None), loss_last)
    if compression is not None and not compression.is_dense and expected.min_sparse_taught_accuracy is not None:
        sparse = chain_measures(records, *_respond(task, model_dir, records, compression), loss_last)
        measured.update({f"sparse_{k}": sparse[k] for k in ("heldout_accuracy", "taught_accuracy", "taught_full_chains",
                                                             "boxes_right")})
    if expected.min_sampled_taught_accuracy is not None:
        taught = [r for r in records if _taught(r)]
        _, right = _respond(task, model_dir, taught, compression, expected.samples_per_problem, temperature, seed)
        measured["sampled_taught_accuracy"] = _share(right)
    return WarmStartCheck(measured, expected, tuple(expected.judge(measured)))


def _respond(task: "CheckedTask", model_dir: str | os.PathLike, records: Sequence["MathRecord"],
             compression: "CompressionConfig | None", n: int = 1, temperature: float = 0.0,
             seed: int = 0) -> tuple[list[str], list[bool]]:
    """``n`` responses per record (greedy at temperature 0; dense, or with ``compression``), record by record, and
    whether each one's reward was positive."""
    engine = HFRolloutEngine(model_dir, compression=compression, show_progress=False)
    prompts = [render_prompt(task.template, r.prompt, engine.tokenizer) for r in records]
    samples = engine.generate(prompts, n, SamplingParams(temperature=temperature, seed=seed,
                                                         max_new_tokens=task.response_tokens + 8))
    for s in samples:
        s.metadata.update(records[s.group_id].metadata())
    with REWARDS.get(task.reward)() as reward:
        verdicts = reward.score_samples(samples)
    ordered = sorted(zip(samples, verdicts), key=lambda sv: sv[0].group_id)
    return [s.response_text for s, _ in ordered], [v.reward > 0 for _, v in ordered]


def chain_measures(records: Sequence["MathRecord"], responses: Sequence[str], right: Sequence[bool],
                   loss_last: float) -> dict[str, float]:
    """The check's values (module docstring) of one greedy response per record (``responses[i]`` to
    ``records[i]``, ``right[i]``: its reward was positive)."""
    if not len(records) == len(responses) == len(right) > 0:
        raise ValueError(f"chain_measures: {len(records)} records, {len(responses)} responses, {len(right)} verdicts")
    full = [full_chain(text, r.extra[CHAIN_KEY]) for r, text in zip(records, responses)]
    taught = [i for i, r in enumerate(records) if _taught(r)]
    return {
        "loss_last": float(loss_last),
        "problems": float(len(records)),
        "heldout_accuracy": _share(list(right)),
        "taught_problems": float(len(taught)),
        "taught_accuracy": _share([right[i] for i in taught]),
        "taught_full_chains": _share([full[i] for i in taught]),
        "full_chains": float(sum(full)),
        "boxes_right": _share([ok for ok, f in zip(right, full) if f]),
    }


def _taught(record: "MathRecord") -> bool:
    """Whether the teacher demonstrated ``record``'s class in full (``TAUGHT_CLASS``, or no class at all)."""
    return record.extra.get(SUBSET_KEY, TAUGHT_CLASS) == TAUGHT_CLASS


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")
