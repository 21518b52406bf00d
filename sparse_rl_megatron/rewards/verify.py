"""Check one response against one gold answer with math-verify (runs inside a verifier worker process).

Order of work, and the reason each outcome gets (``Verdict.reason``):
1. find the final answer in the response (``extract.extract_answer``) -> ``no_answer`` if there is none;
2. parse the gold and the answer with math-verify, each wrapped as ``\\boxed{..}``;
3. ``math_verify.verify(gold, answer)``, gold first (the check is not symmetric) -> ``correct``; else
   ``parse_error`` if the answer is not a math expression math-verify can read (it only hands back the
   raw string: ``\\frac{1}{}``, ``2+``, ``x=``) or math-verify raised, and ``wrong`` otherwise.
A check that runs past its time (or memory) budget is ``timeout``; the pool enforces that, see ``pool.py``.

math-verify's own timeouts use ``signal.alarm`` with whole seconds and fail outside the main thread, so
they are switched off here (``parsing_timeout=None``, ``timeout_seconds=None``): the worker process owns
the clock (``pool.py``). Imports only the standard library and math-verify (no torch): workers start fast.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from sparse_rl_megatron.rewards.extract import extract_answer

REASONS = ("correct", "wrong", "no_answer", "timeout", "parse_error")
"""Every reason a verdict can carry."""

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one response."""

    reward: float
    """1.0 if correct, else 0.0."""
    reason: str
    """One of ``REASONS``."""
    answer: str | None = None
    """The final answer found in the response (None if there was none)."""
    detail: str = ""
    """Why, when it is not plainly correct or wrong (exception text, time limit)."""

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"Verdict.reason must be one of {', '.join(REASONS)}, got '{self.reason}'")

    @property
    def correct(self) -> bool:
        return self.reason == "correct"

    def to_dict(self) -> dict:
        return {"reward": self.reward, "reason": self.reason, "answer": self.answer, "detail": self.detail}


def normalize_gold(gold: str) -> str:
    """Gold answer text as math-verify should see it inside ``\\boxed{}``.

    Published gold fields sometimes keep their math delimiters (``"$221$, $8$"``, ``"20 $cm^{2}$"``):
    unescaped ``$`` are removed (``\\$`` is a literal dollar sign and stays).
    """
    return _UNESCAPED_DOLLAR.sub("", str(gold)).strip()


def _quiet_math_verify_logs() -> None:
    # math-verify warns once per process that its own timeout is off (we time out in pool.py), and logs
    # each parse failure; both are expected here and would flood a run's log.
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.utils"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _parse(text: str):
    from math_verify import parse

    return parse("\\boxed{" + text + "}", parsing_timeout=None)


_GOLD_CACHE: dict[str, list] = {}
# Parsed gold answers kept per worker: a rollout batch holds a few hundred distinct problems.
_GOLD_CACHE_SIZE = 4096


def _parse_gold(gold: str):
    # The n samples of a GRPO group share one gold answer: parse it once per worker. Only parses that
    # produced a math expression are kept: math-verify turns internal errors (even MemoryError) into an
    # empty or string-only result, which must not be remembered as the gold's meaning.
    if gold in _GOLD_CACHE:
        return _GOLD_CACHE[gold]
    parsed = _parse(gold)
    if any(not isinstance(p, str) for p in parsed):
        if len(_GOLD_CACHE) >= _GOLD_CACHE_SIZE:
            _GOLD_CACHE.pop(next(iter(_GOLD_CACHE)))
        _GOLD_CACHE[gold] = parsed
    return parsed


def check_answer(response: str, gold: str, style: str = "boxed") -> Verdict:
    """Verdict for ``response`` against ``gold`` (no time limit: call it from a verifier worker).

    ``style`` is the answer style of the data set (``boxed`` or ``boxed_or_number``, see ``extract.py``).
    """
    from math_verify import verify

    _quiet_math_verify_logs()
    answer = extract_answer(response, style)
    if answer is None or not answer.strip():
        return Verdict(0.0, "no_answer", answer)
    try:
        gold_text = normalize_gold(gold)
        gold_parsed = _parse_gold(gold_text)
        if not gold_parsed:
            return Verdict(0.0, "parse_error", answer, f"math-verify found nothing in the gold answer {gold!r}")
        # An answer written exactly like the gold parses exactly like it: reuse that parse (parsing is most
        # of the cost of a check, and correct answers are often verbatim).
        pred_parsed = gold_parsed if answer.strip() == gold_text else _parse(answer)
        if not pred_parsed:
            return Verdict(0.0, "parse_error", answer, "math-verify found nothing to compare in the answer")
        ok = verify(gold_parsed, pred_parsed, timeout_seconds=None)
        if not ok and all(isinstance(p, str) for p in pred_parsed):
            # Only math-verify's string fallback came back: the answer is not readable math. (A readable
            # text answer such as \text{Evelyn} parses to a symbol and is compared as usual.)
            return Verdict(0.0, "parse_error", answer, "math-verify could not parse the answer")
    except MemoryError:  # the worker's memory cap was hit: pool.py reports it as a timeout
        raise
    except RecursionError:  # deep nesting: sympy / the LaTeX parser recurse per level
        return Verdict(0.0, "parse_error", answer, "nesting too deep (RecursionError)")
    except Exception as exc:  # noqa: BLE001 - a malformed answer must never crash the run
        return Verdict(0.0, "parse_error", answer, f"{type(exc).__name__}: {str(exc)[:200]}")
    return Verdict(1.0 if ok else 0.0, "correct" if ok else "wrong", answer)
