"""Install the carried wheels (``bench/gpu_wheels/``, from ``bench/gpu_wheels.sh``) into a target folder.

The device has no network: ``pip install --no-index --no-deps --target SITE wheel...``, then SITE goes first on
every part's ``PYTHONPATH``. A wheel listed in ``ONLY_IF_OLDER`` is installed only when the machine's own copy
is missing or older than the version megatron-core asks for (so the device's packages are not shadowed for
nothing). Without pip, a wheel is a zip archive: it is unpacked into SITE (a ``.data/purelib`` or
``platlib`` folder merged in), which is what ``pip --target`` does for these wheels.
"""
from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL_DIR = Path(__file__).resolve().parents[1] / "gpu_wheels"
ONLY_IF_OLDER = {"packaging": "24.2", "psutil": "0"}
"""Distribution -> the oldest version the kit accepts from the machine (packaging: megatron-core 0.16.1's pin;
psutil: any, megatron-core's checkpoint writers only need it importable)."""


def _dist_name(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower().replace("_", "-")


def _older(have: str, need: str) -> bool:
    def key(v: str) -> tuple:
        return tuple(int(p) if p.isdigit() else 0 for p in v.split(".")[:3])

    return key(have) < key(need)


def fits_this_python(wheel: Path) -> bool:
    """The wheel's Python and ABI tags admit the running CPython: ``cp312``, ``py3``/``py2.py3``, or a stable-ABI
    ``cp36-abi3`` wheel built for this minor version or an older one."""
    python, abi = wheel.name[:-len(".whl")].split("-")[-3:-1]
    this = (sys.version_info.major, sys.version_info.minor)
    for tag in python.split("."):
        if tag == "py3" or tag == f"cp{this[0]}{this[1]}":
            return True
        if abi == "abi3" and tag.startswith("cp3") and (3, int(tag[3:])) <= this:
            return True
    return False


def wanted(wheels: list[Path]) -> tuple[list[Path], list[str]]:
    """``(wheels to install, why each other one is left out)``."""
    take, skipped = [], []
    this = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for w in wheels:
        name = _dist_name(w)
        if not fits_this_python(w):
            skipped.append(f"{w.name} (not for {this}: the environment's own {name} is used)")
            continue
        need = ONLY_IF_OLDER.get(name)
        if need is not None:
            try:
                have = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                have = None
            if have is not None and not _older(have, need):
                skipped.append(f"{w.name} (the machine has {name} {have} >= {need})")
                continue
        take.append(w)
    return take, skipped


def _unzip(wheel: Path, site: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    for data in site.glob("*.data"):
        for sub in ("purelib", "platlib"):
            src = data / sub
            if src.is_dir():
                shutil.copytree(src, site, dirs_exist_ok=True)
        shutil.rmtree(data)


def install(site: Path, wheel_dir: Path = WHEEL_DIR) -> dict:
    """Install the wanted wheels of ``wheel_dir`` into ``site``; returns what was done (for the record)."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        return dict(installed=[], skipped=[], method="none",
                    note=f"no wheels in {wheel_dir}: megatron-core must already be importable here")
    take, skipped = wanted(wheels)
    site.mkdir(parents=True, exist_ok=True)
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if take and has_pip:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade", "--quiet",
               "--disable-pip-version-check", "--target", str(site), *map(str, take)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install --target failed ({proc.returncode}): {proc.stderr[-1500:]}")
    else:
        for w in take:
            _unzip(w, site)
    return dict(installed=[w.name for w in take], skipped=skipped, method="pip" if has_pip else "unzip",
                site=str(site), carried_mib=round(sum(w.stat().st_size for w in wheels) / 2**20, 2))
