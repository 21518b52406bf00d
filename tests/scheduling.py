"""How the suite shares the machine's cores: two pytest-xdist workers (``-n 2 --dist loadgroup`` in pytest.ini) take
whole groups of tests, longest group first.

Most of the suite's time is one busy core: a child process (an SGLang scheduler, a ``sparse-rl train`` run) computes
while the test waits on it. Two workers keep both cores of a 2-core machine busy; a test that starts two torchrun
ranks shares them with the other worker's test for a while, which every timeout in the suite allows (it passed
under a load of 10-25 on 2 cores, 2026-12-03).

A group is one test file, except files that share a session fixture which must run once per session: the megatron
tier's torchrun launches (``tests/megatron/conftest.py``) and the real-model tier's converted checkpoint in
pytest's cache. Each of those tiers is one group. Groups start in order of their measured seconds
(``file_seconds.json``: seconds per file of a full run, written by ``python tests/scheduling.py REPORT.xml`` from a
``--junitxml`` report), so the last group to start is a short one; a file missing from the table counts 0 s and
starts last. The table only orders the groups: a stale one costs time, never a result.
"""
from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
SECONDS_FILE = HERE / "file_seconds.json"

SHARED_SESSION_FIXTURES = {
    "megatron": "mcore_refs",  # the HF references and the single/pair/grid torchrun launches
    "realmodel": "smollm2",  # the GGUF conversion, cached in pytest's cache directory
}
"""tier -> the session fixture that makes the tier's files one group (when a file uses it)."""


def group_of(path: pathlib.Path, fixtures: set[str]) -> str:
    """The xdist group of a test file (``path`` relative to the repository root) whose tests use ``fixtures``."""
    tier = path.parts[1] if len(path.parts) > 2 else ""
    shared = SHARED_SESSION_FIXTURES.get(tier)
    if shared is not None and shared in fixtures:
        return f"{tier}-session"
    return path.as_posix()


def group_seconds(groups: dict[str, list[str]]) -> dict[str, float]:
    """group -> its files' measured seconds summed (0 for files the table lacks)."""
    table = json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.is_file() else {}
    return {group: sum(table.get(f, 0.0) for f in set(files)) for group, files in groups.items()}


def _write_table(report: str) -> None:
    import xml.etree.ElementTree as ET

    seconds: dict[str, float] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/") + ".py"
        seconds[name] = seconds.get(name, 0.0) + float(case.get("time", 0.0))
    ordered = {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]) if v >= 1.0}
    SECONDS_FILE.write_text(json.dumps(ordered, indent=0) + "\n")
    print(f"wrote {SECONDS_FILE} ({len(ordered)} files of >= 1 s, {sum(ordered.values()):.0f} s in all)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/scheduling.py REPORT.xml   (from pytest --junitxml=REPORT.xml, a full run)")
    _write_table(sys.argv[1])
