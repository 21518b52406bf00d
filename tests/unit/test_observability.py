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


def test_plot_has_integer_steps_and_full_metric_names():
    import matplotlib.pyplot as plt

    from sparse_rl_megatron.observability.plots import build_figure

    # 3 steps: matplotlib's default locator would put ticks at 1.0, 1.25, 1.5, ...
    records = [{"step": s, "rollout/truncated_frac": 0.1 * s, "sparse/truncated_frac": 0.2} for s in (1, 2, 3)]
    fig = build_figure(records)
    (ax,) = [a for a in fig.axes if a.get_title() == "truncation"]
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rollout/truncated_frac", "sparse/truncated_frac"]
    plt.close(fig)


def test_plot_command_writes_png_and_refuses_a_non_run(tmp_path, capsys):
    from sparse_rl_megatron.cli import main

    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "run directory" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    assert f"{tmp_path} has no metrics.jsonl" in capsys.readouterr().err
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(1, {"rollout/reward_mean": 0.5, "eval/dense/accuracy": 0.2})
    writer.write(2, {"rollout/reward_mean": 0.7})
    writer.close()
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_resumed_writer_drops_steps_after_the_checkpoint(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(5):
        writer.write(step, {"a": step})
    writer.close()
    writer = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)  # the checkpoint was at step 2
    writer.write(3, {"a": 30})
    writer.close()
    assert [(r["step"], r["a"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(0, 0), (1, 1), (2, 2), (3, 30)]
