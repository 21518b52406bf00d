"""Shared test set-up: one torch thread (2-core machines are noisy), tiers by folder, shared-data path."""
from __future__ import annotations

import os
import pathlib

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Tests read the real benchmark files from ../shared/data (see its README); override with SPARSE_RL_DATA.
SHARED_DATA = pathlib.Path(os.environ.get("SPARSE_RL_DATA", ROOT.parent / "shared" / "data"))

# Every test in tests/<tier>/ gets the marker <tier>, so `pytest -m unit` runs one tier.
_TIERS = ("unit", "megatron", "sglang", "e2e", "realmodel")
_GROUP = pytest.StashKey[str]()


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one worker (tests/scheduling.py)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group markers
def pytest_collection_modifyitems(config, items):
    from scheduling import group_of, group_seconds

    groups: dict[str, list[str]] = {}
    for item in items:
        path = pathlib.Path(str(item.fspath)).relative_to(ROOT)
        if len(path.parts) > 2 and path.parts[1] in _TIERS:
            item.add_marker(getattr(pytest.mark, path.parts[1]))
        group = group_of(path, set(getattr(item, "fixturenames", ())))
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(path.as_posix())
        item.stash[_GROUP] = group
    if getattr(config.option, "dist", "no") != "no":  # longest group first (tests/scheduling.py)
        seconds = group_seconds(groups)
        items.sort(key=lambda item: -seconds[item.stash[_GROUP]])


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (set SPARSE_RL_DATA)")
    return SHARED_DATA


_STOP_SIGNALS = ("SIGTERM", "SIGINT")
"""Their handlers are inherited as ignored by every process a test starts (a launcher whose SIGTERM was ignored
on entry cannot trap it): a test that changes them restores them."""


@pytest.fixture(autouse=True)
def _stop_signal_handlers_restored(request):
    import signal

    before = {name: signal.getsignal(getattr(signal, name)) for name in _STOP_SIGNALS}
    yield
    changed = [name for name in _STOP_SIGNALS if signal.getsignal(getattr(signal, name)) != before[name]]
    for name in changed:
        signal.signal(getattr(signal, name), before[name])
    assert not changed, f"{request.node.nodeid} left the handlers of {changed} changed (restored now)"
