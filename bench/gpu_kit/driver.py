"""Run the parts in order, each in its own process under its time box; keep and report what each finished.

A part's limit is its box plus the seconds the parts before it left unused, never past the run's deadline.
The part knows its own deadline (it stops a long measurement and writes what it has); at the limit plus a
grace period the driver ends the part's process group (SIGTERM, then SIGKILL). Records written before then
stay. The report (``results.json``, ``results.md``) is rewritten after the set-up and after every part, so a
driver killed from outside still leaves the last one.
"""
from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_kit import report, wheels
from gpu_kit.records import RECORDS_FILE, Recorder, read_records
from gpu_kit.sizes import Sizes

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "bench" / "gpu_check.py"
GRACE_S = 8
"""Seconds past its limit before a part's processes are ended: the part's own deadline fires first."""
MIN_PART_S = 5
"""A part with less time left than this is skipped (it could not even import torch)."""
LOG_KEEP_BYTES = 256 * 1024
"""Each part's log is cut to its last 256 KiB (the results folder travels back from the device)."""


def part_env(site: Path, cpu: bool) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), str(ROOT / "bench"), env.get("PYTHONPATH", "")])
    if cpu:
        # every allocation above 128 KiB its own mapping, returned when freed: the peak RSS (the CPU memory
        # meter) then follows the live tensors instead of glibc's dynamically raised mmap threshold
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    return env


def _keep_previous(out: Path) -> None:
    """A re-run into the same folder moves the earlier records aside instead of mixing or losing them."""
    old = out / RECORDS_FILE
    if old.is_file():
        stamp = datetime.datetime.fromtimestamp(old.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
        old.rename(out / f"records.{stamp}.jsonl")


def _trim(log: Path) -> None:
    if log.is_file() and log.stat().st_size > LOG_KEEP_BYTES:
        data = log.read_bytes()[-LOG_KEEP_BYTES:]
        log.write_bytes(b"[... cut ...]\n" + data)


def run_part(cmd: list[str], env: dict, limit: float, log: Path, grace: float = GRACE_S) -> tuple[str, int | None]:
    """Run one part's process in its own session; ``("done", exit code)``, or ``("timed out", code)`` after its
    process group was ended at ``limit + grace`` seconds."""
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return ("done", proc.wait(timeout=limit + grace))
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
            return ("timed out", proc.returncode)


def _status(name: str, outcome: str, rc: int | None, out: Path) -> str:
    items = [r for r in read_records(out) if r["part"] == name and r["item"] != report.STATUS_ITEM]
    failed = [r["item"] for r in items if not r.get("ok")]
    if outcome == "timed out":
        return f"timed out ({len(items) - len(failed)} items kept)"
    if rc != 0:
        return f"failed (exit {rc}; see logs/{name}.log)"
    if not items:
        return "failed (no results)"
    return f"failed: {', '.join(failed)}" if failed else "ok"


def run(sizes: Sizes, cpu: bool, out: Path, work: Path, parts: list[str], deadline_s: float | None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    _keep_previous(out)
    budget = deadline_s or sizes.deadline_s
    t0 = time.monotonic()
    header = dict(preset=sizes.label, mode="cpu" if cpu else "gpu", started=datetime.datetime.now().isoformat(
        timespec="seconds"), budget_s=budget, out=str(out), work=str(work), python=sys.executable)
    if shutil.which("nvidia-smi") and not cpu:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        (out / "nvidia-smi.txt").write_text(smi.stdout + smi.stderr)
    setup = Recorder(out, "setup", t0 + sizes.boxes["setup"])
    start = time.monotonic()
    with setup.item("carried wheels") as m:
        m.update(wheels.install(work / "site"))
    setup.write(report.STATUS_ITEM, status=_status("setup", "done", 0, out),
                seconds=round(time.monotonic() - start, 1), box_s=sizes.boxes["setup"])
    report.write(out, header)
    env = part_env(work / "site", cpu)
    planned = time.monotonic() - t0
    jit_fusions = True
    for name in parts:
        planned += sizes.boxes[name]
        elapsed = time.monotonic() - t0
        limit = min(planned - elapsed, budget - elapsed)
        rec = Recorder(out, name, 0)
        if limit < MIN_PART_S:
            rec.write(report.STATUS_ITEM, status="skipped (no time left)", seconds=0, box_s=sizes.boxes[name])
            continue
        if name != "model" and not (work / "model" / "config.json").is_file():
            rec.write(report.STATUS_ITEM, status="skipped (no model checkpoint: the model part failed)", seconds=0,
                      box_s=sizes.boxes[name])
            continue
        cmd = [sys.executable, str(ENTRY), "--part", name, "--out", str(out), "--work", str(work),
               "--deadline-at", str(time.time() + limit)] + (["--cpu"] if cpu else [])
        if not jit_fusions:
            cmd.append("--no-jit-fusions")
        print(f"== {name}: up to {limit:.0f} s", flush=True)
        start = time.monotonic()
        outcome, rc = run_part(cmd, env, limit, out / "logs" / f"{name}.log")
        _trim(out / "logs" / f"{name}.log")
        rec.write(report.STATUS_ITEM, status=_status(name, outcome, rc, out),
                  seconds=round(time.monotonic() - start, 1),
                  box_s=round(limit, 1), exit_code=rc)
        if name == "model":
            jit_fusions = not any(r["part"] == "model" and r["item"].startswith("torch.compile") and not r["ok"]
                                  for r in read_records(out))
        report.write(out, dict(header, elapsed_s=round(time.monotonic() - t0, 1), jit_fusions=jit_fusions))
    header.update(elapsed_s=round(time.monotonic() - t0, 1), jit_fusions=jit_fusions)
    js, md = report.write(out, header)
    text = md.read_text()
    glance = text.find("## At a glance")
    cut = text.find("\n## ", glance + 1 if glance >= 0 else 0)
    print(text if cut < 0 else text[:cut], flush=True)  # the statuses and headline; the rest is in the file
    print(f"results: {js} and {md}", flush=True)
    statuses = [r["status"] for r in read_records(out) if r["item"] == report.STATUS_ITEM]
    return 0 if statuses and all(s == "ok" for s in statuses) else 1
