"""Metric keys have one home (``observability/metric_names.py``): no module of the package spells one outside it
(the writers and the readers import the names), no reader builds one with an f-string, and the keys are the strings
saved runs hold."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import sparse_rl_megatron
from sparse_rl_megatron.observability import metric_names as MN

ROOT = Path(sparse_rl_megatron.__file__).parent
HOME = ROOT / "observability" / "metric_names.py"
KEYS = {name: value for name, value in vars(MN).items() if name.isupper() and isinstance(value, str) and "/" in value}
NAMESPACES = sorted({key.split("/")[0] for key in KEYS.values()} | {"control"})
KEY_LIKE = re.compile(r"^(%s)/[A-Za-z0-9_.{}]+(/[A-Za-z0-9_.{}]+)*$" % "|".join(NAMESPACES))
DATA_FILE = re.compile(r"\.(jsonl|json|py)$")
READERS = ("experiment", "observability/plots.py", "mismatch", "eval", "trainer/loop.py", "trainer/run.py",
           "trainer/runtime/progress.py", "compression/budget_controller.py")
"""What reads metrics (records of ``metrics.jsonl``, a step's metrics, a study's): none builds a key itself."""


def _spelled_keys(path: Path, *, f_strings: bool) -> list[str]:
    """``line: text`` of every string in ``path`` that spells a metric key (not docstrings; f-strings by their
    text with ``{}`` for each field, when ``f_strings``)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs | parts:
            text = node.value
        elif f_strings and isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        else:
            continue
        if KEY_LIKE.match(text) and not DATA_FILE.search(text):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    return found


def test_no_module_spells_a_metric_key_outside_its_home():
    paths = sorted(path for path in ROOT.rglob("*.py") if path != HOME)
    spelled = [hit for path in paths for hit in _spelled_keys(path, f_strings=False)]
    assert not spelled, "metric keys spelled outside observability/metric_names.py:\n" + "\n".join(spelled)


def test_readers_build_no_metric_key_with_an_f_string():
    paths = sorted(p for r in READERS for p in ((ROOT / r).rglob("*.py") if (ROOT / r).is_dir() else [ROOT / r]))
    built = [hit for path in paths if path != HOME for hit in _spelled_keys(path, f_strings=True)]
    assert not built, "metric keys built in readers (use metric_names):\n" + "\n".join(built)


def test_the_names_are_the_keys_saved_runs_hold():
    """One name per key, and the keys of a run's record as ``metrics.jsonl`` has always spelled them."""
    assert len(set(KEYS.values())) == len(KEYS)
    assert (MN.ROLLOUT_REWARD_MEAN, MN.SPARSE_RHO_P1, MN.RHO_P0_1, MN.TIME_SYNC_S) == (
        "rollout/reward_mean", "sparse/rho_p1", "rho/p0.1", "time/sync_s")
    assert (MN.EVAL_DENSE_SHORTCUT_FREE_ACCURACY, MN.eval_key(MN.SPARSE, "gsm8k", MN.ACCURACY)) == (
        "eval/dense/shortcut_free_accuracy", "eval/sparse/gsm8k/accuracy")
    assert MN.SUBSET_ACCURACY_KEY.match(MN.EVAL_DENSE_MODCHAIN_WEAK_REST_ACCURACY).groups() == ("dense", "rest")
    assert MN.control_key(MN.SFT_STEPS) == "control/steps"


def test_the_home_imports_the_stdlib_only():
    """``algo/`` and ``compression/`` import it (``test_algo_imports.py``): it must stay framework-free."""
    tree = ast.parse(HOME.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "re"}, imported
