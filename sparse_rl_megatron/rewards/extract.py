"""Find the final answer in a model response (or in a gold worked solution).

Pure string functions (standard library only), shared by the reward workers and the dataset loader:
- ``last_boxed``: the content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces),
  as in the MATH / Qwen2.5-Math evaluation convention;
- ``trailing_number``: the last number in the text (GSM8K-style answers);
- ``gsm8k_gold``: the number on the ``#### N`` line of a GSM8K worked solution;
- ``extract_answer``: one of the above chosen by an answer style name.
"""
from __future__ import annotations

import re

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")

# A number: optional sign, digits with optional thousands commas, optional decimals (or ".5").
_NUMBER_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+")
_GSM8K_GOLD_RE = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)

# Answer styles: how a response's final answer is found.
ANSWER_STYLES = ("boxed", "boxed_or_number")


def _braced(text: str, open_pos: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[open_pos] == '{'`` and the index after its ``}``.

    Escaped braces (``\\{``, ``\\}``) are literal characters in LaTeX and do not open or close groups.
    Returns None when the group never closes (a truncated response).
    """
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (\{, \}, \\)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : i], i + 1
        i += 1
    return None


def _box_argument(text: str, start: int) -> str | None:
    """The argument of the box command ending at ``start``: ``{...}`` or the unbraced ``\\boxed 5`` form."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        got = _braced(text, i)
        return None if got is None else got[0]
    if i > start:  # "\boxed 5": the argument runs to the next space or '$'
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces kept), or None.

    A box left open at the end (a truncated response) is not an answer; an earlier complete one is used.
    """
    for m in reversed(list(_BOX_RE.finditer(text))):
        arg = _box_argument(text, m.end())
        if arg is not None:
            return arg.strip()
    return None


def _clean_number(raw: str) -> str:
    return raw.replace(",", "")


def trailing_number(text: str) -> str | None:
    """The last number in ``text`` with thousands commas removed (``"... so $1,250."`` -> ``"1250"``)."""
    matches = _NUMBER_RE.findall(text)
    return _clean_number(matches[-1]) if matches else None


def gsm8k_gold(solution: str) -> str | None:
    """The answer on the last ``#### N`` line of a GSM8K worked solution, commas and ``$`` removed."""
    lines = _GSM8K_GOLD_RE.findall(solution)
    if not lines:
        return None
    value = lines[-1].replace("$", "").strip()
    number = trailing_number(value)
    return number if number is not None else (value or None)


def extract_answer(text: str, style: str = "boxed") -> str | None:
    """The final answer of ``text`` under ``style``.

    ``boxed``: the last complete ``\\boxed{}`` (None if there is none).
    ``boxed_or_number``: the last ``\\boxed{}``, else the ``#### N`` line, else the last number (GSM8K-style).
    """
    if style not in ANSWER_STYLES:
        raise ValueError(f"answer style '{style}' is unknown; valid styles: {', '.join(ANSWER_STYLES)}")
    boxed = last_boxed(text)
    if boxed is not None or style == "boxed":
        return boxed
    return gsm8k_gold(text) or trailing_number(text)
