"""``sparse-rl train`` with partial rollouts (``rollout.partial``, issue 54) end to end on CPU: the embedded default in
its fast form with responses sampled in 6-token calls, stopped by SIGTERM while responses are carried over, resumed:
every step's metrics equal the uninterrupted run's (the checkpoint holds the samples in flight), and the carried
responses' tokens span weight versions."""
from __future__ import annotations

import json
import signal
import subprocess
import time

from test_train import _comparable, _env, _records, _train

PARTIAL = ["rollout.partial.enabled=true", "rollout.partial.segment_tokens=6", "rollout.partial.extra_groups=2",
           "rollout.partial.max_staleness=2", "steps=4"]


def test_partial_rollouts_stop_and_resume_equals_the_uninterrupted_run(tmp_path, shared_data):
    env = _env(shared_data)
    whole, split = tmp_path / "whole", tmp_path / "split"
    a = subprocess.Popen(_train(whole, *PARTIAL), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen(_train(split, *PARTIAL), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400
    while not ((split / "metrics.jsonl").is_file() and any(r["step"] >= 2 for r in _records(split))):
        assert b.poll() is None and time.monotonic() < deadline, b.communicate()[1][-3000:]
        time.sleep(0.1)
    b.send_signal(signal.SIGTERM)  # stops at the end of the current step, after a checkpoint
    out, err = b.communicate(timeout=300)
    assert b.returncode == 0, err[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 1, out[-2000:]
    k = int(stopped[0].split()[3])
    assert 2 <= k < 4
    state = json.loads((split / "checkpoints" / f"step_{k}" / "trainer_state.json").read_text())
    carried = [s for s in state["partial"]["in_flight"] if len(s["response_ids"]) < 16 and s["finish_reason"] == "length"]
    assert carried, "no response was carried over at the stop: the resume would not test them"

    resumed = subprocess.run(_train(split, *PARTIAL), env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out, err = a.communicate(timeout=600)
    assert a.returncode == 0, err[-3000:]
    whole_records, split_records = _records(whole), _records(split)
    assert [r["step"] for r in whole_records] == [0, 1, 2, 3, 4] == [r["step"] for r in split_records]
    for w, s in zip(whole_records, split_records):
        assert _comparable(w) == _comparable(s), f"step {w['step']} differs"
    steps = whole_records[1:]
    assert all(r["rollout/partial/segments"] >= 1 for r in steps)
    assert max(r["rollout/partial/staleness_max"] for r in steps) >= 1           # some trained tokens are a version old
    assert max(r["rollout/partial/carried_requests"] for r in steps) > 0
    assert any("sparse/partial/abs_log_rho_lagged_mean" in r for r in steps)
    assert all(r["rollout/partial/staleness_max"] <= 2 for r in steps)
