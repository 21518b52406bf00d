"""The plugin's test-only fault switches (``sglang_ext/config.py``'s ``FAULT_ENV``) are read once, into
``PluginFaults`` when the backend is built: the modules on the paths they break never look at the environment."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sglang_ext
from sglang_ext.config import FAULT_ENV, PLUGIN_FAULTS, PluginFaults

PLUGIN = Path(sglang_ext.__file__).parent
HOT_PATHS = ("backend.py", "compaction.py", "hooks.py")
"""The modules whose per-call paths a fault switches (the backend's forward, compaction, the scheduler hooks)."""


@pytest.mark.parametrize("value", ["", *PLUGIN_FAULTS, "bogus"])
def test_each_fault_is_one_flag(monkeypatch, value):
    monkeypatch.setenv(FAULT_ENV, value)
    faults = PluginFaults.from_env()
    assert {name for name in PLUGIN_FAULTS if getattr(faults, name)} == ({value} if value in PLUGIN_FAULTS else set())


def test_the_plugin_reads_no_environment_on_its_hot_paths():
    lookups = []
    for name in HOT_PATHS:
        tree = ast.parse((PLUGIN / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") or \
                    isinstance(node, ast.Name) and node.id == "FAULT_ENV":
                lookups.append(f"{name}:{node.lineno}")
    assert not lookups, f"environment read on a hot path: {lookups}"
