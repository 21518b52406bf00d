"""The algorithm core stays framework-free: torch, the stdlib and utils.registry only."""
import ast
import pathlib
import sys

import sparse_rl_megatron.algo as algo

ALLOWED_PROJECT = ("sparse_rl_megatron.algo", "sparse_rl_megatron.utils.registry")


def test_algo_imports_only_torch_stdlib_and_registry():
    bad = []
    for path in pathlib.Path(algo.__file__).parent.glob("*.py"):
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
                if name.startswith(ALLOWED_PROJECT):
                    continue
                bad.append(f"{path.name}: {name}")
    assert not bad, bad


def test_public_api_is_exported():
    for name in algo.__all__:
        assert hasattr(algo, name), name
    assert "prepare_correction" in algo.__all__ and "micro_batch_loss" in algo.__all__
