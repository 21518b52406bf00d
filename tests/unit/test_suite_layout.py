"""The suite itself: any selection of its folders collects (a test file imports helpers from a module of a name of
its own, never from ``conftest``: every tier has one, and the first one imported would shadow the others)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_file_imports_from_a_conftest():
    found = [f"{p.relative_to(TESTS)}:{n}" for p in sorted(TESTS.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.match(r"\s*(from|import) conftest\b", line)]
    assert not found, f"import helpers from a module of their own, not from conftest: {found}"


def test_two_tiers_collect_together():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--collect-only",
                           str(TESTS / "realmodel"), str(TESTS / "sglang")], cwd=TESTS.parent, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and " collected" in proc.stdout.splitlines()[-1], proc.stdout[-3000:] + proc.stderr[-2000:]
