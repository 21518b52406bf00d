"""No import circles inside ``sparse_rl_megatron``: every module's imports of the package's modules (at module level
and inside functions, but not the type-only ones under ``if TYPE_CHECKING:``), read with ``ast``, form a graph
without cycles. A circle means two modules each need the other: one idea split over two files (or a helper living
in the wrong one)."""
from __future__ import annotations

import ast
from pathlib import Path

import sparse_rl_megatron

ROOT = Path(sparse_rl_megatron.__file__).parent
PACKAGE = "sparse_rl_megatron"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for inner in ast.walk(child):
                    skip.add(id(inner))
    return skip


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` of a name inside a module
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                found.add(target)
    return found


def import_cycles() -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_the_package_has_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles (each line: modules that import each other, directly or around a circle):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)
