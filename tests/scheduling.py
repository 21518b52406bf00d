"""How the suite shares the machine's cores: two pytest-xdist workers (``-n 2 --dist loadscope`` in pytest.ini)
take whole groups of tests, longest group first (``GroupScheduling``, installed by ``tests/conftest.py``).

Most of the suite's time is one busy core: a child process (an SGLang scheduler, a ``sparse-rl train`` run) computes
while the test waits on it. Two workers keep both cores of a 2-core machine busy; a test that starts two torchrun
ranks shares them with the other worker's test for a while, which every timeout in the suite allows (it passed
under a load of 10-25 on 2 cores, 2026-12-03).

A group is one test file (its module fixtures run once), except the tiers whose files share session fixtures that
must run once: the megatron tier's torchrun launches (``tests/megatron/conftest.py``) and the real-model tier's
converted checkpoint in pytest's cache are one group each. Groups start in order of their measured seconds
(``file_seconds.json``: seconds per file of a full run, written by ``python tests/scheduling.py REPORT.xml`` from a
``--junitxml`` report), so the last group to start is a short one; a file missing from the table counts 0 s and
starts last. The table only orders the groups: a stale one costs time, never a result.

(xdist's own ``--dist loadgroup`` cannot do this here: it renames items by assigning ``Item._nodeid``, which
pytest 9 no longer reads.)
"""
from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
SECONDS_FILE = HERE / "file_seconds.json"

SHARED_SESSION_TIERS = ("megatron", "realmodel")
"""Tiers whose test files share session fixtures that must run once: each is one group."""


def group_of(nodeid: str) -> str:
    """The group of a test: its file (``tests/<tier>/test_x.py``), or ``<tier>-session`` for the tiers above."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in SHARED_SESSION_TIERS:
        return f"{parts[1]}-session"
    return path


def group_seconds(groups: dict[str, list[str]]) -> dict[str, float]:
    """group -> its files' measured seconds summed (0 for files the table lacks)."""
    table = json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.is_file() else {}
    return {group: sum(table.get(f, 0.0) for f in set(files)) for group, files in groups.items()}


def longest_group_first(nodeids: list[str]) -> list[int]:
    """The order (indexes into ``nodeids``) that runs the groups longest first, each group's tests in their order."""
    groups: dict[str, list[str]] = {}
    for nodeid in nodeids:
        groups.setdefault(group_of(nodeid), []).append(nodeid.split("::", 1)[0])
    seconds = group_seconds(groups)
    return sorted(range(len(nodeids)), key=lambda i: -seconds[group_of(nodeids[i])])


def make_scheduler(config, log):
    """xdist's scope scheduler with ``group_of`` as the scope; the workers' collection is already in
    ``longest_group_first`` order (``--no-loadscope-reorder`` keeps it)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


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
