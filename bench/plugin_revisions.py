"""Run a plugin benchmark once per version of ``sglang_ext``: this checkout's, and a git revision's (``--rev``), each
in a fresh child process whose ``PYTHONPATH`` puts that version first. Used by ``bench_host_ms.py`` and
``bench_host_syncs.py`` to print old and new side by side."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
THIS_CHECKOUT = "this checkout"


def run_per_revision(script: str, rev: str | None, child_args: Callable[[str], list[str]]) -> dict[str, Any]:
    """label (``THIS_CHECKOUT``, then ``rev``) -> the JSON that ``script`` prints last when run with
    ``child_args(label)`` against that version of the plugin."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in [THIS_CHECKOUT] + ([rev] if rev else []):
            path = [str(ROOT)]
            if label != THIS_CHECKOUT:
                archive = subprocess.run(["git", "-C", str(ROOT), "archive", label, "sglang_ext"], check=True,
                                         capture_output=True).stdout
                subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
                path.insert(0, tmp)
            env = {"PYTHONPATH": ":".join(path), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
            out = subprocess.run([sys.executable, script, *child_args(label)], env=env, capture_output=True,
                                 text=True, check=True).stdout
            results[label] = json.loads(out.strip().splitlines()[-1])
    return results
