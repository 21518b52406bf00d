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
from reaper import pytest_configure  # noqa: E402,F401  (the run's reaper: no process outlives a killed run)

torch.set_num_threads(1)

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Tests read the real benchmark files from ../shared/data (see its README); override with SPARSE_RL_DATA.
SHARED_DATA = pathlib.Path(os.environ.get("SPARSE_RL_DATA", ROOT.parent / "shared" / "data"))

# Every test in tests/<tier>/ gets the marker <tier>, so `pytest -m unit` runs one tier.
_TIERS = ("unit", "megatron", "sglang", "e2e", "realmodel")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = pathlib.Path(str(item.fspath)).relative_to(ROOT / "tests").parts
        if parts and parts[0] in _TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
    if hasattr(config, "workerinput"):  # an xdist worker: groups longest first (tests/scheduling.py)
        from scheduling import longest_group_first

        order = longest_group_first([item.nodeid for item in items])
        items[:] = [items[i] for i in order]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None  # another --dist: xdist's own scheduler
    from scheduling import make_scheduler

    return make_scheduler(config, log)


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
