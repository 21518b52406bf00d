"""Metrics JSONL + TensorBoard + PNG plots."""
from __future__ import annotations

import math

from sparse_rl_megatron.observability.metrics_writer import MetricsWriter, read_metrics
from sparse_rl_megatron.observability.plots import plot_metrics


def test_metrics_jsonl_tensorboard_and_plot(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(3):
        writer.write(step, {"rollout/reward_mean": step / 2, "sparse/rho_p1": 0.5, "loss/pg": math.nan,
                            "sparse/kl_k1": "not a number"})
    writer.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rollout/rew')  # a torn line from a crash
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["rollout/reward_mean"] for r in records] == [0.0, 0.5, 1.0]
    assert records[0]["loss/pg"] is None and records[0]["sparse/kl_k1"] is None
    assert any((tmp_path / "tensorboard").iterdir())
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "metrics.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "none.png", panels={"x": ("absent",)}) is None
