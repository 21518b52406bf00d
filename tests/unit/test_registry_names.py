"""Compressor and correction-mode names are spelled out in their registries only.

An AST scan of ``sparse_rl_megatron/`` and ``sglang_ext/``: no list, tuple or set literal holds two names of one
registry (a list of methods or modes beside the registry drifts from it: a new entry is missing there), and no
``.method`` / ``.mode`` is compared with a registered name (a branch on a name instead of on what the entry
declares). The registries' own modules are where the names live.
"""
from __future__ import annotations

import ast
from pathlib import Path

from sparse_rl_megatron.algo.modes import CORRECTION_MODES
from sparse_rl_megatron.compression.scorers import SCORERS

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("sparse_rl_megatron", "sglang_ext")
REGISTRIES = {
    "compressor": (SCORERS, "method", {"sparse_rl_megatron/compression/scorers.py"}),
    "correction mode": (CORRECTION_MODES, "mode", {"sparse_rl_megatron/algo/modes.py"}),
}
CHOICES = {
    ("sparse_rl_megatron/mismatch/gradient_cli.py", "a literal of ['none', 'sparse_rl']"),
}
"""Literals that are a choice among the registered names, not a list of them: ``sparse-rl gradients``' default
pair (naive vs Sparse-RL)."""


def _strings(node: ast.AST) -> set[str]:
    return {e.value for e in getattr(node, "elts", ()) if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def _compared_name(node: ast.Compare, attribute: str) -> set[str]:
    """String literals a ``<x>.<attribute>`` is compared with (``==``, ``!=``, ``in``, ``not in``)."""
    sides = [node.left, *node.comparators]
    if not any(isinstance(s, ast.Attribute) and s.attr == attribute for s in sides):
        return set()
    names = set()
    for s in sides:
        if isinstance(s, ast.Constant) and isinstance(s.value, str):
            names.add(s.value)
        names |= _strings(s)
    return names


def spelled_names(source: str, names: set[str], attribute: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every collection literal with two of ``names`` and every comparison of an
    ``.<attribute>`` with one of them, in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            hit = _strings(node) & names
            if len(hit) >= 2:
                found.append((node.lineno, f"a literal of {sorted(hit)}"))
        elif isinstance(node, ast.Compare):
            hit = _compared_name(node, attribute) & names
            if hit:
                found.append((node.lineno, f".{attribute} compared with {sorted(hit)}"))
    return found


def _violations(kind: str) -> list[str]:
    registry, attribute, homes = REGISTRIES[kind]
    names = set(registry.names())
    out = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in homes:
                continue
            out += [f"{rel}:{line}: {what}" for line, what in spelled_names(path.read_text(), names, attribute)
                    if (rel, what) not in CHOICES]
    return out


def test_no_list_of_compressor_names_outside_the_registry():
    assert _violations("compressor") == []


def test_no_list_of_correction_mode_names_outside_the_registry():
    assert _violations("correction mode") == []


def test_the_scan_sees_what_it_forbids():
    names = {"rkv", "snapkv", "none"}
    assert spelled_names('M = ("rkv", "snapkv")', names, "method") == [(1, "a literal of ['rkv', 'snapkv']")]
    assert spelled_names('if cfg.method == "rkv": pass', names, "method") == [(1, ".method compared with ['rkv']")]
    assert spelled_names('if c.method in ["rkv"]: pass', names, "method") == [(1, ".method compared with ['rkv']")]
    assert spelled_names('x = ["rkv", "other"]; y = c.scope == "rkv"', names, "method") == []
