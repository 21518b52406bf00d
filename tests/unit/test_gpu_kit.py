"""The GPU acceptance kit's own machinery (bench/gpu_kit): the carried-wheel rules, records that survive a failed or
cut measurement, the driver ending a part at its limit, and the engine part stopping at its deadline with the
steps it finished. The whole kit at toy sizes runs in tests/e2e/test_gpu_check.py."""
import json
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_kit import records, report, wheels  # noqa: E402
from gpu_kit.driver import run_part  # noqa: E402

THIS = f"cp{sys.version_info.major}{sys.version_info.minor}"


def test_wheel_tags_admit_this_python_only():
    assert wheels.fits_this_python(Path(f"megatron_core-0.16.1-{THIS}-{THIS}-manylinux_2_28_x86_64.whl"))
    assert not wheels.fits_this_python(Path("megatron_core-0.16.1-cp39-cp39-manylinux_2_28_x86_64.whl"))
    assert wheels.fits_this_python(Path("packaging-26.0-py3-none-any.whl"))
    assert wheels.fits_this_python(Path("psutil-7.2.2-cp36-abi3-manylinux_2_28_x86_64.whl"))  # stable ABI
    assert not wheels.fits_this_python(Path("x-1.0-cp399-abi3-manylinux_2_28_x86_64.whl"))


def test_wheels_the_machine_already_has_are_not_installed(tmp_path, monkeypatch):
    have = {"packaging": "23.0", "psutil": "7.0.0"}

    def version(name):
        if name not in have:
            raise wheels.importlib.metadata.PackageNotFoundError(name)
        return have[name]

    monkeypatch.setattr(wheels.importlib.metadata, "version", version)
    names = [f"megatron_core-0.16.1-{THIS}-{THIS}-linux_x86_64.whl", "packaging-26.0-py3-none-any.whl",
             "psutil-7.2.2-cp36-abi3-linux_x86_64.whl"]
    take, skipped = wheels.wanted([Path(n) for n in names])
    assert [w.name for w in take] == names[:2]  # packaging 23.0 is older than megatron-core's 24.2
    assert skipped == ["psutil-7.2.2-cp36-abi3-linux_x86_64.whl (the machine has psutil 7.0.0 >= 0)"]
    del have["psutil"]
    assert len(wheels.wanted([Path(n) for n in names])[0]) == 3


def test_a_wheel_unpacks_without_pip(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo/__init__.py", "VALUE = 1\n")
        z.writestr("demo-1.0.data/purelib/demo_extra.py", "X = 2\n")
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
    site = tmp_path / "site"
    site.mkdir()
    wheels._unzip(wheel, site)
    assert (site / "demo" / "__init__.py").is_file() and (site / "demo_extra.py").is_file()
    assert not list(site.glob("*.data"))


def test_no_wheels_is_said_not_failed(tmp_path):
    done = wheels.install(tmp_path / "site", tmp_path / "no-wheels")
    assert done["installed"] == [] and "megatron-core must already be importable" in done["note"]


def test_a_failed_or_cut_measurement_keeps_what_it_had_and_the_part_goes_on(tmp_path):
    rec = records.Recorder(tmp_path, "p", time.monotonic() + 60)
    with rec.item("raises") as m:
        m["half"] = 1
        raise ValueError("boom")
    with rec.item("cut") as m:
        m["steps"] = 7
        raise records.Deadline("stopped after 7 steps")
    with rec.item("fine") as m:
        m["x"] = 2.5
    (tmp_path / records.RECORDS_FILE).open("a").write('{"part": "p", "item": "half a li')  # a kill mid-write
    got = records.read_records(tmp_path)
    assert [(r["item"], r["ok"]) for r in got] == [("raises", False), ("cut", False), ("fine", True)]
    assert got[0]["half"] == 1 and got[0]["error"] == "ValueError: boom" and "Traceback" in got[0]["traceback"]
    assert got[1]["partial"] and got[1]["steps"] == 7 and got[2]["x"] == 2.5
    text = report.markdown({"preset": "t"}, got)
    assert "| raises |" in text and "boom" in text and "## p" in text


def test_a_part_past_its_limit_is_ended(tmp_path):
    start = time.monotonic()
    outcome, code = run_part([sys.executable, "-c", "import time; time.sleep(300)"], {}, 0.5, tmp_path / "log",
                             grace=0.5)
    assert outcome == "timed out" and code is not None and time.monotonic() - start < 30


def test_engine_stops_at_its_deadline_with_the_steps_done(tmp_path):
    from gpu_kit import part_engine
    from gpu_kit.sizes import TOY

    from sparse_rl_megatron.models.tiny import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model("qwen2", vocab_size=256, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    prompts = [list(range(3, 3 + TOY.eng_prompt_len))] * TOY.eng_prompts
    m: dict = {}
    with pytest.raises(records.Deadline):
        part_engine.measure(model, "rkv", TOY, prompts, time.monotonic() - 1, m)
    assert m["complete"] is False and m["decode_steps"] == 0 and m["cache_mib_per_seq"] > 0
    full: dict = {}
    part_engine.measure(model, "rkv", TOY, prompts, time.monotonic() + 600, full)
    assert full["complete"] and full["decode_steps"] == TOY.eng_response - 1 and full["events_per_seq"] > 20
    assert json.dumps(full)  # a JSON record as it stands
