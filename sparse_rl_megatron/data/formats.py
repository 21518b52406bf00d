"""Field mapping of each published file layout to ``MathRecord`` fields.

Each format is a function ``(row: dict, line: int) -> dict`` returning the keyword arguments of
``MathRecord`` except ``dataset``; it raises ``MalformedRow`` (naming the field) for a row it cannot use.
Field names differ between the published sets on purpose (see ``../shared/data/README.md``).
"""
from __future__ import annotations

from typing import Any, Callable

from sparse_rl_megatron.rewards.extract import gsm8k_gold, last_boxed
from sparse_rl_megatron.rewards.verify import normalize_gold
from sparse_rl_megatron.utils.registry import Registry

RowMapper = Callable[[dict, int], dict]
FORMATS: Registry[RowMapper] = Registry("data file format")


class MalformedRow(ValueError):
    """A row that lacks a usable field; the loader skips and counts it."""


def text_field(row: dict, key: str) -> str:
    """``row[key]`` as non-empty text (numbers are formatted: ``27.0`` -> ``"27"``)."""
    if key not in row or row[key] is None:
        raise MalformedRow(f"missing field '{key}' (fields present: {', '.join(sorted(row)) or 'none'})")
    value = row[key]
    if isinstance(value, bool):
        raise MalformedRow(f"field '{key}' is a boolean, expected text or a number")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (list, tuple)):
        if not value:
            raise MalformedRow(f"field '{key}' is an empty list")
        value = ", ".join(str(v) for v in value)
    if not isinstance(value, (str, int, float)):
        raise MalformedRow(f"field '{key}' has type {type(value).__name__}, expected text or a number")
    text = str(value).strip()
    if not text:
        raise MalformedRow(f"field '{key}' is empty")
    return text


def gold_field(row: dict, key: str) -> str:
    """A gold answer field, with stray ``$`` math delimiters removed."""
    gold = normalize_gold(text_field(row, key))
    if not gold:
        raise MalformedRow(f"field '{key}' holds no answer once '$' delimiters are removed")
    return gold


def row_id(row: dict, line: int, key: str | None) -> str:
    if key and row.get(key) is not None and str(row[key]).strip():
        return str(row[key])
    return f"L{line}"


def _keep(row: dict, *keys: str) -> dict[str, Any]:
    return {k: row[k] for k in keys if row.get(k) is not None}


@FORMATS.register("gsm8k")
def gsm8k(row: dict, line: int) -> dict:
    """question; answer = worked solution ending in ``#### N`` (gold = N); idx."""
    solution = text_field(row, "answer")
    gold = gsm8k_gold(solution)
    if gold is None:
        raise MalformedRow("field 'answer' has no '#### N' line")
    return dict(prompt=text_field(row, "question"), answer=gold, source_id=row_id(row, line, "idx"),
                answer_style="boxed_or_number", extra={"solution": solution})


@FORMATS.register("math500")
def math500(row: dict, line: int) -> dict:
    """problem; answer; solution; subject; level; unique_id."""
    return dict(prompt=text_field(row, "problem"), answer=gold_field(row, "answer"),
                source_id=row_id(row, line, "unique_id"),
                extra=_keep(row, "solution", "subject", "level"))


def _boxed_solution(row: dict) -> tuple[str, str]:
    solution = text_field(row, "solution")
    gold = last_boxed(solution)
    if not gold:
        raise MalformedRow("field 'solution' has no complete \\boxed{...} answer")
    return solution, normalize_gold(gold)


@FORMATS.register("minerva_math")
def minerva_math(row: dict, line: int) -> dict:
    """problem; solution (gold = its last ``\\boxed{}``); type; idx."""
    solution, gold = _boxed_solution(row)
    return dict(prompt=text_field(row, "problem"), answer=gold, source_id=row_id(row, line, "idx"),
                extra={"solution": solution, **_keep(row, "type")})


@FORMATS.register("gaokao2023en")
def gaokao2023en(row: dict, line: int) -> dict:
    """question; answer (may keep ``$`` delimiters); id (not on every row); source."""
    return dict(prompt=text_field(row, "question"), answer=gold_field(row, "answer"),
                source_id=row_id(row, line, "id"), extra=_keep(row, "source", "sourcename"))


@FORMATS.register("olympiadbench")
def olympiadbench(row: dict, line: int) -> dict:
    """question (after ``context`` when present); final_answer (a list; joined with ", "); id; unit."""
    question = text_field(row, "question")
    if row.get("context"):
        question = f"{str(row['context']).strip()}\n\n{question}"
    return dict(prompt=question, answer=gold_field(row, "final_answer"), source_id=row_id(row, line, "id"),
                extra=_keep(row, "unit", "answer_type", "is_multiple_answer", "subfield"))


@FORMATS.register("aime")
def aime(row: dict, line: int) -> dict:
    """problem; answer; solution; id; url."""
    return dict(prompt=text_field(row, "problem"), answer=gold_field(row, "answer"),
                source_id=row_id(row, line, "id"), extra=_keep(row, "solution", "url"))


@FORMATS.register("amc")
def amc(row: dict, line: int) -> dict:
    """problem (also as question); answer (a float such as 27.0 -> "27"); id; url."""
    prompt_key = "problem" if row.get("problem") else "question"
    return dict(prompt=text_field(row, prompt_key), answer=gold_field(row, "answer"),
                source_id=row_id(row, line, "id"), extra=_keep(row, "url"))


@FORMATS.register("math")
def math_train(row: dict, line: int) -> dict:
    """problem; solution (gold = its last ``\\boxed{}``); level ("Level 1".."Level 5"); type."""
    solution, gold = _boxed_solution(row)
    return dict(prompt=text_field(row, "problem"), answer=gold, source_id=row_id(row, line, None),
                extra={"solution": solution, **_keep(row, "level", "type")})


def user_format(input_key: str, label_key: str, *, id_key: str | None = None,
                answer_style: str = "boxed", label_is_solution: bool = False) -> RowMapper:
    """A mapper for a user file: prompt from ``input_key``, gold from ``label_key``.

    ``label_is_solution``: the label is a worked solution; the gold is its last ``\\boxed{}`` (or its
    ``#### N`` line / last number for ``answer_style='boxed_or_number'``).
    """

    def mapper(row: dict, line: int) -> dict:
        if label_is_solution:
            from sparse_rl_megatron.rewards.extract import extract_answer

            gold = extract_answer(text_field(row, label_key), answer_style)
            if not gold:
                raise MalformedRow(f"field '{label_key}' has no final answer ({answer_style})")
            gold = normalize_gold(gold)
        else:
            gold = gold_field(row, label_key)
        extra = {k: v for k, v in row.items() if k not in (input_key, label_key)}
        return dict(prompt=text_field(row, input_key), answer=gold, source_id=row_id(row, line, id_key),
                    answer_style=answer_style, extra=extra)

    return mapper
