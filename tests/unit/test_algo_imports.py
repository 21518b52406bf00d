"""The algorithm core and the KV compression operators stay framework-free: torch, the stdlib, utils.registry and
the metric names (``observability/metric_names.py``, constants on the stdlib alone) only (so the SGLang plugin and any
learner can import them)."""
import ast
import pathlib
import sys

import pytest

import sparse_rl_megatron.algo as algo
import sparse_rl_megatron.compression as compression


@pytest.mark.parametrize("package", [algo, compression], ids=["algo", "compression"])
def test_package_imports_only_torch_stdlib_and_registry(package):
    own = package.__name__
    bad = []
    files = list(pathlib.Path(package.__file__).parent.glob("*.py"))
    assert len(files) > 3
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "torch" or top in sys.stdlib_module_names or top == "__future__":
                    continue
                metric_names = isinstance(node, ast.ImportFrom) and name == "sparse_rl_megatron.observability" \
                    and [a.name for a in node.names] == ["metric_names"]
                if name.startswith((own, "sparse_rl_megatron.utils.registry")) or metric_names:
                    continue
                bad.append(f"{path.name}: {name}")
    assert not bad, bad


def test_public_api_is_exported():
    for name in algo.__all__:
        assert hasattr(algo, name), name
    assert "prepare_correction" in algo.__all__ and "micro_batch_loss" in algo.__all__
