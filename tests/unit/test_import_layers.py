"""No import circles inside ``sparse_rl_megatron``, and no import from a lower layer to a higher one: every module's
imports of the package's modules (at module level, inside functions and the type-only ones under ``if
TYPE_CHECKING:``), read with ``ast``, form a graph without cycles, and every edge goes to a module of the same layer
or a lower one (``LAYERS``). A circle means two modules each need the other: one idea split over two files (or a
helper living in the wrong one); an arrow up means a part reaches into what is built on it."""
from __future__ import annotations

import ast
from pathlib import Path

import sparse_rl_megatron

ROOT = Path(sparse_rl_megatron.__file__).parent
PACKAGE = "sparse_rl_megatron"
PLUGIN = "sglang_ext"
"""The SGLang plugin, a package of its own beside the library: it is layered with it."""
LAYERS = (
    ("utils",),
    ("algo", "compression", "models", "rewards", "observability", "rollout.sample"),
    ("data", "learner", PLUGIN),
    ("rollout", "planning"),
    ("tasks",),
    ("eval",),
    ("trainer.config",),
    ("planning.recipe", "planning.cli"),
    ("trainer.runtime",),
    ("trainer.checkpointing",),
    ("trainer.engine_pool",),
    ("trainer",),
    ("mismatch", "experiment"),
    ("cli", "convert_cli"),
)
"""Lowest first: a module may import modules of its own layer and of lower ones, type-only imports included. Names are
module paths below the package (``trainer`` is the trainer's top-level modules; its sub-packages and its config are
layers of their own; ``rollout.sample``, the data type engines return and rewards score, sits with the torch-only
parts it needs; the planner's front-ends, ``planning.cli`` and ``planning.recipe``, read a training recipe, so they
sit above ``trainer.config``)."""


def _modules(roots: tuple[Path, ...] = (ROOT,)) -> dict[str, Path]:
    out = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                for inner in ast.walk(child):
                    skip.add(id(inner))
    return skip


def _imports(name: str, path: Path, modules: dict[str, Path], type_only: bool = False) -> set[str]:
    """The package modules ``name`` imports (``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``);
    ``type_only``: also those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skip = set() if type_only else _type_checking_nodes(tree)
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
            if target.split(".")[0] in (PACKAGE, PLUGIN) and target != name:
                found.add(target)
    return found


def import_cycles() -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted; the package and the plugin.
    Type-only imports count: a circle through one still means two modules that each need the other's idea."""
    modules = _modules((ROOT, ROOT.parent / PLUGIN))
    return _cycles({m: _imports(m, p, modules, type_only=True) for m, p in modules.items()})


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one node of ``graph`` (Tarjan), each sorted."""
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


def part_of(module: str) -> str:
    """The ``LAYERS`` name a module belongs to (its longest listed prefix), or the module itself."""
    parts = module.split(".")
    if parts[0] == PLUGIN:
        return PLUGIN
    listed = {name for names in LAYERS for name in names}
    return next((".".join(parts[1:n]) for n in range(len(parts), 1, -1) if ".".join(parts[1:n]) in listed), module)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of a module (``sparse_rl_megatron.x.y`` or ``sglang_ext.z``): its longest listed
    prefix; the package's own ``__init__`` is the top."""
    parts = module.split(".")
    if parts[0] == PLUGIN:
        return next(i for i, names in enumerate(LAYERS) if PLUGIN in names)
    below = parts[1:]
    for length in range(len(below), 0, -1):
        name = ".".join(below[:length])
        for i, names in enumerate(LAYERS):
            if name in names:
                return i
    return len(LAYERS)


def upward_imports(modules: dict[str, Path] | None = None) -> list[str]:
    """Every import (type-only ones too) of a module of a higher layer than the importer's (``importer -> imported``)
    among ``modules`` (default: the package and the plugin)."""
    modules = modules if modules is not None else _modules((ROOT, ROOT.parent / PLUGIN))
    return sorted(f"{m} -> {t}" for m, p in modules.items() for t in _imports(m, p, modules, type_only=True)
                  if layer_of(t) > layer_of(m))


def test_no_module_imports_a_higher_layer():
    up = upward_imports()
    assert not up, "imports from a lower layer to a higher one (LAYERS):\n" + "\n".join(up)


def test_no_circle_between_the_parts_of_a_layer():
    modules = _modules((ROOT, ROOT.parent / PLUGIN))
    graph: dict[str, set[str]] = {}
    for m, p in modules.items():
        graph.setdefault(part_of(m), set()).update(part_of(t) for t in _imports(m, p, modules) if part_of(t) != part_of(m))
    for targets in list(graph.values()):
        for t in targets:
            graph.setdefault(t, set())
    cycles = _cycles(graph)
    assert not cycles, "parts that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_part_of_the_package_has_a_layer():
    modules = _modules((ROOT, ROOT.parent / PLUGIN))
    unplaced = sorted(m for m in modules if layer_of(m) == len(LAYERS) and m != PACKAGE)
    assert not unplaced, f"modules outside LAYERS: {unplaced}"


def test_the_layer_check_sees_an_arrow_up_and_the_cycle_check_a_circle(tmp_path):
    """Seeded defects: a torch-only module that imports the trainer (at run time, then for types only) is reported;
    two modules importing each other are a circle."""
    assert layer_of("sparse_rl_megatron.algo.ratio") < layer_of("sparse_rl_megatron.trainer.loop")
    assert layer_of("sparse_rl_megatron.trainer.config") < layer_of("sparse_rl_megatron.trainer.runtime.model_dirs")
    pkg = tmp_path / PACKAGE
    (pkg / "algo").mkdir(parents=True)
    (pkg / "trainer").mkdir()
    for f in ("__init__.py", "algo/__init__.py", "trainer/__init__.py", "trainer/loop.py"):
        (pkg / f).write_text("")
    (pkg / "algo" / "ratio.py").write_text("def f():\n    from sparse_rl_megatron.trainer.loop import train\n")
    modules = _modules((pkg,))
    assert upward_imports(modules) == ["sparse_rl_megatron.algo.ratio -> sparse_rl_megatron.trainer.loop"]
    (pkg / "algo" / "ratio.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from sparse_rl_megatron.trainer.loop import train\n")
    assert upward_imports(modules) == ["sparse_rl_megatron.algo.ratio -> sparse_rl_megatron.trainer.loop"]
    (pkg / "trainer" / "loop.py").write_text("from sparse_rl_megatron.algo import ratio\n")
    (pkg / "algo" / "ratio.py").write_text("from sparse_rl_megatron.trainer import loop\n")
    graph = {m: _imports(m, p, modules) for m, p in _modules((pkg,)).items()}
    assert _cycles(graph) == [["sparse_rl_megatron.algo.ratio", "sparse_rl_megatron.trainer.loop"]]
