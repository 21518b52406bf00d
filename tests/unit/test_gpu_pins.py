"""The GPU requirement pins agree with what the pinned frameworks declare (read from their installed metadata):
Transformer Engine within megatron-core's range with the CUDA 13 core, torch at SGLang's pin, and the TE
PyTorch extension installed the way NVIDIA documents (--no-build-isolation, after torch)."""
import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PY311 = {"python_version": "3.11", "extra": ""}


def _requirements(name: str) -> list[Requirement]:
    lines = (ROOT / "requirements" / name).read_text().splitlines()
    return [Requirement(line) for line in (ln.split(" #")[0].strip() for ln in lines) if line and not line.startswith("#")]


def _declared(dist: str, package: str, extra: str = "") -> Requirement:
    for text in metadata.requires(dist):
        req = Requirement(text)
        if canonicalize_name(req.name) == package and (req.marker is None or req.marker.evaluate({"extra": extra})):
            return req
    raise AssertionError(f"{dist} declares no {package} (extra {extra!r})")


def _te(name: str) -> Requirement:
    (req,) = [r for r in _requirements(name) if canonicalize_name(r.name) == "transformer-engine"
              and r.marker.evaluate(PY311)]
    return req


def test_transformer_engine_is_pinned_inside_megatron_cores_range():
    assert metadata.version("megatron-core") == "0.16.1"
    wanted = _declared("megatron-core", "transformer-engine", extra="dev")  # >=2.9.0a0,<2.12.0 [core_cu13,pytorch]
    for name in ("gpu.txt", "gpu-te.txt"):
        req = _te(name)
        (pin,) = req.specifier
        assert pin.operator == "==" and wanted.specifier.contains(pin.version, prereleases=True), (name, req)
        assert {canonicalize_name(e) for e in req.extras} >= {"core-cu13"}
    assert "pytorch" in _te("gpu-te.txt").extras and "pytorch" not in _te("gpu.txt").extras


def test_gpu_torch_is_sglangs_and_te_builds_without_isolation():
    script = (ROOT / "launch" / "setup_env.sh").read_text()
    torch_pin = _declared("sglang", "torch").specifier
    assert f'TORCH_VERSION_GPU="{next(iter(torch_pin)).version}"' in script
    gpu = script[script.index('"[setup] GPU recipe'):]
    steps = [gpu.index("torch==$TORCH_VERSION_GPU\"\n"), gpu.index("requirements/gpu.txt"),
             gpu.index("--no-build-isolation -r \"$ROOT/requirements/gpu-te.txt\"")]
    assert steps == sorted(steps)
    assert re.search(r"^sglang==0\.5\.23$", (ROOT / "requirements" / "gpu.txt").read_text(), re.M)
