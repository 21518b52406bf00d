"""The megatron (and real-model) framework tests name their worker checks by function object, never by string.

A check is a function of the test file decorated with ``mcore_check`` (``tests/megatron/workers/mcore_worker.py``);
its test calls ``<launch>.check(check_fn, **params)``. This scans every ``.check(`` call of the framework tiers, and
every ``<name>launch.check(`` call anywhere in tests/, for a first argument that is a string: a literal, an f-string,
or a test parameter that ``pytest.mark.parametrize`` fills with strings.
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FRAMEWORK_TIERS = ("megatron", "realmodel")


def _string_params(fn: ast.FunctionDef) -> set[str]:
    """Parameters of ``fn`` that a ``parametrize`` decorator fills with at least one string."""
    names: set[str] = set()
    for deco in fn.decorator_list:
        if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                and deco.func.attr == "parametrize" and len(deco.args) >= 2
                and isinstance(deco.args[0], ast.Constant) and isinstance(deco.args[0].value, str)):
            continue
        argnames = [a.strip() for a in deco.args[0].value.split(",")]
        values = deco.args[1].elts if isinstance(deco.args[1], (ast.List, ast.Tuple)) else []
        for value in values:
            row = value.elts if len(argnames) > 1 and isinstance(value, (ast.List, ast.Tuple)) else [value]
            names |= {n for n, v in zip(argnames, row) if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return names


def _receiver(node: ast.expr) -> str:
    while isinstance(node, (ast.Attribute, ast.Call)):
        node = node.value if isinstance(node, ast.Attribute) else node.func
    return node.id if isinstance(node, ast.Name) else ""


def string_named_checks(source: str, name: str, framework: bool) -> list[str]:
    """``name:line`` of each ``.check(`` call in ``source`` whose check is named by a string (every ``.check(``
    call in a ``framework`` tier's file, elsewhere those on a ``...launch``)."""
    tree = ast.parse(source, name)
    found = []

    def visit(node: ast.AST, string_params: set[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            string_params = string_params | _string_params(node)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check"
                and node.args and (framework or _receiver(node.func.value).endswith("launch"))):
            arg = node.args[0]
            if (isinstance(arg, ast.JoinedStr) or (isinstance(arg, ast.Constant) and isinstance(arg.value, str))
                    or (isinstance(arg, ast.Name) and arg.id in string_params)):
                found.append(f"{name}:{node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, string_params)

    visit(tree, set())
    return found


def test_the_scan_finds_each_way_of_naming_a_check_by_string():
    """Seeded: a literal, an f-string and a string parameter are found; a function object is not; outside the
    framework tiers only a launch's ``.check(`` counts."""
    probe = (
        "import pytest\n"
        "def test_a(single_launch):\n"
        "    single_launch.check('cpu_compat')\n"
        "    single_launch.check(check_fn, model='x')\n"
        "@pytest.mark.parametrize('fixture,check', [('single_launch', 'nan'), ('pair_launch', check_fn)])\n"
        "def test_b(request, fixture, check, model):\n"
        "    request.getfixturevalue(fixture).check(check)\n"
        "    request.getfixturevalue(fixture).check(f'tp1_{model}')\n"
        "    registry.check('zz', field='cfg.kind')\n")
    lines = [int(s.rsplit(":", 1)[1]) for s in string_named_checks(probe, "probe.py", framework=True)]
    assert lines == [3, 7, 8, 9]
    assert string_named_checks(probe, "probe.py", framework=False) == ["probe.py:3"]


def test_no_check_is_named_by_a_string():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS)
        found += string_named_checks(path.read_text(), str(rel), rel.parts[0] in FRAMEWORK_TIERS)
    assert not found, f"checks named by string (pass the check function instead): {found}"
