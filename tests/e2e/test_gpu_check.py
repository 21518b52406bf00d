"""``bench/gpu_check.py --cpu``: every part of the GPU acceptance kit at its toy sizes, the same code an H200 runs,
so the kit cannot rot between the rare runs on a lent device. One run for the module (about 45 s on an idle
2-core machine: six part processes, each paying the torch + megatron-core imports)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"setup", "model", "logprobs", "lm_head_memory", "train", "train_recompute", "engine"}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("gpu-check-out"), tmp_path_factory.mktemp("gpu-check-work")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu", "--out", str(out),
                           "--work", str(work)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    results = out / "results.json"
    assert results.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(results.read_text()), out


def _item(records, part, prefix):
    found = [r for r in records if r["part"] == part and r["item"].startswith(prefix)]
    assert found, f"no record {part}/{prefix}*"
    return found[0]


def test_every_part_passes_and_imports_nothing_the_device_lacks(cpu_run):
    proc, results, out = cpu_run
    statuses = {r["part"]: r["status"] for r in results["records"] if r["item"] == "_status"}
    logs = {p.name: p.read_text()[-1500:] for p in (out / "logs").glob("*.log")}
    assert statuses == dict.fromkeys(PARTS, "ok"), (statuses, logs)
    assert proc.returncode == 0
    imports = [r for r in results["records"] if r["item"].startswith("imports none of")]
    assert len(imports) == len(PARTS) - 1 and all(r["found"] == [] for r in imports)


def test_learner_matches_hf_and_the_chunked_head_saves_memory(cpu_run):
    records = cpu_run[1]["records"]
    fp32, bf16 = _item(records, "logprobs", "learner float32"), _item(records, "logprobs", "learner bfloat16")
    assert fp32["max_abs"] < 1e-4 and fp32["tokens"] == 2 * 48
    assert bf16["max_abs"] < 0.05 and "spec=local" in bf16["learner"]
    for call in ("logprobs", "train_step"):
        chunked = _item(records, "lm_head_memory", f"{call}, LM head chunked")["peak_rise_bytes"]
        unchunked = _item(records, "lm_head_memory", f"{call}, LM head unchunked")["peak_rise_bytes"]
        # the unchunked head holds [1024, 16384] fp32 logits (64 MiB); a 128-token chunk holds 8 MiB
        assert chunked < 0.9 * unchunked, (call, chunked, unchunked)
    for part, item in (("train", "train step"), ("train_recompute", "train step (full recompute)")):
        step = _item(records, part, item)
        assert step["tokens"] == 4 * 128 and step["tokens_per_s"] > 0 and step["skipped"] == 0
    assert "recompute_granularity=full" in _item(records, "train_recompute", "train step")["learner"]


def test_distributed_optimizer_checkpoint_restores_weights_and_optimizer_state(cpu_run):
    ckpt = _item(cpu_run[1]["records"], "train", "checkpoint")
    assert ckpt["ok"], ckpt.get("error")
    assert ckpt["restored_max_abs"] == 0.0 and ckpt["replayed_step_max_abs"] <= 0.1 * ckpt["step_moved_logprobs"]


def test_engine_decodes_every_method_and_the_compressed_cache_is_smaller(cpu_run):
    records = cpu_run[1]["records"]
    dense, rkv, snap = (_item(records, "engine", f"decode {m}") for m in ("dense", "rkv", "snapkv"))
    for r in (dense, rkv, snap):
        assert r["complete"] and r["decode_steps"] == r["response"] - 1 == 127
        assert r["cache_mib_per_seq"] >= r["planned_kv_mib_per_seq"]  # K/V plus positions and the query window
    assert dense["events_per_seq"] == 0 and rkv["events_per_seq"] > 20 and snap["events_per_seq"] > 20
    assert rkv["cache_mib_per_seq"] < dense["cache_mib_per_seq"] / 3
    assert rkv["fits_in_budget_by_cache"] > 3 * dense["fits_in_budget_by_cache"]
    ratios = _item(records, "engine", "dense vs compressed")
    assert ratios["common_steps"] == 112 and ratios["rkv_tok_s_x_dense"] > 0


def test_report_has_the_summary_and_every_part(cpu_run):
    text = (cpu_run[2] / "results.md").read_text()
    assert "## At a glance" in text and "checkpoint save + load (distributed optimizer)" in text
    for part in PARTS - {"setup"}:
        assert f"## {part}" in text


def test_offload_moves_the_learner_bytes_the_ledger_says(cpu_run):
    """The kit's ``learner.offload: all`` item (part ``train``): asleep 0 bytes per part, the allocator's (here the
    storages') bytes fall by what was freed, woken bit for bit, each part within 1% of the plan."""
    item = _item(cpu_run[1]["records"], "train", "offload all")
    assert item["ok"], item
    assert item["asleep_parts"] == {"weights": 0, "gradients": 0, "optimizer": 0}
    assert item["freed_bytes"] == item["allocated_drop_bytes"] > 0 and item["logprobs_max_abs"] == 0.0
    assert item["worst_part_vs_plan"] < 0.01
