"""What ``sparse-rl mismatch`` writes and prints: a results JSON, a table, the log-rho histograms (PNG).

Results file (``FORMAT_VERSION`` 1; NaN is written as null)::

    {"format_version": 1, "command": "sparse-rl mismatch",
     "meta": {"model_path", "dataset", "template", "engine", "engine_dtype", "learner", "world_size", "prompts",
              "samples_per_prompt", "sampling": {...}, "sampler_seed", "correction": {...}, "notes": [...],
              "probe_max_abs_diff", "dense_tolerance", "config": {the resolved train config}},
     "histogram_edges": [... bins + 1 log-rho edges shared by every row ...],
     "rows": [{"label", "compression": {...}, "stats": {...}, "histogram": [... counts ...],
               "samples": [{"group", "index", "source_id", "reward", "response_tokens", "finish_reason",
                            "compression_events", "peak_kv_tokens", "log_rho_sum", "rho_min", "kept"}]}]}
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparse_rl_megatron.algo.rho_stats import histogram_counts, histogram_edges
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.utils.config_io import to_dict

if TYPE_CHECKING:
    from sparse_rl_megatron.mismatch.measure import Measurement

FORMAT_VERSION = 1
HISTOGRAM_BINS = 60
"""Equal-width log-rho bins shared by every row (between the smallest and largest log rho of the study)."""
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("reward", MN.ROLLOUT_REWARD_MEAN, ".3f"),
    ("resp len", MN.ROLLOUT_RESPONSE_LEN_MEAN, ".1f"),
    ("trunc", MN.ROLLOUT_TRUNCATED_FRAC, ".2f"),
    ("KV peak mean", MN.ROLLOUT_KV_TOKENS_PEAK_MEAN, ".0f"),
    ("KV peak max", MN.ROLLOUT_KV_TOKENS_PEAK_MAX, ".0f"),
    ("KV vs dense", MN.ROLLOUT_KV_RETAINED_FRAC, ".2f"),
    ("compr. events", MN.ROLLOUT_COMPRESSION_EVENTS_MEAN, ".1f"),
    ("rho min", MN.RHO_MIN, ".2g"),
    ("p0.1", MN.RHO_P0_1, ".3g"),
    ("p1", MN.RHO_P1, ".3g"),
    ("p5", MN.RHO_P5, ".3g"),
    ("p50", MN.RHO_P50, ".4g"),
    ("p99", MN.RHO_P99, ".3g"),
    ("max |log rho|", MN.LOG_RHO_ABS_MAX, ".2g"),
    ("rejected tok", MN.SPARSE_REJECTED_TOKEN_FRAC, ".3f"),
    ("vetoed seq", MN.SPARSE_VETOED_SEQ_FRAC, ".3f"),
    ("contaminated seq", MN.SPARSE_CONTAMINATED_FRAC, ".3f"),
)
"""Table columns: header, stats key, format. ``KV vs dense``: mean over samples of the peak KV tokens held over the
prompt + response tokens a dense cache holds for the same sample. ``contaminated seq``: share of samples with any
token rho < 0.5, the adaptive budget's default signal (pick its target from this column)."""
MOE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("routing flips", MN.MOE_ROUTING_FLIP_FRAC, ".3f"),
    ("contaminated, dense routing", MN.MOE_CONTAMINATED_FRAC_DENSE_ROUTING, ".3f"),
    ("p1, dense routing", MN.MOE_RHO_P1_DENSE_ROUTING, ".3g"),
)
"""Added for a mixture of experts (``mismatch/routing.py``): the share of (token, layer) routings the compressed
cache changes, and the contamination and rho p1 with the sampler routed as the dense model routes (the attention's
share of the tail; the rest of ``contaminated seq`` is the routing's). Blank in the dense row."""
REPLAY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("flips vs learner", MN.MOE_LEARNER_FLIP_FRAC, ".4f"),
    ("tok flips vs learner", MN.MOE_LEARNER_TOKEN_FLIP_FRAC, ".3f"),
    ("contaminated, replay", MN.MOE_CONTAMINATED_FRAC_REPLAY, ".3f"),
    ("p1, replay", MN.MOE_RHO_P1_REPLAY, ".3g"),
    ("max |log rho|, replay", MN.MOE_LOG_RHO_ABS_MAX_REPLAY, ".2g"),
)
"""Added for a mixture of experts whose engine recorded the sampler's routes (``routing.replay_split``), every row:
the share of (fed token, layer) routings, and of fed tokens, where the sampler and the learner's dense recompute
pick different experts (the dense row: precision and kernels alone), and the tail with routing replay."""


def _finite(value: Any) -> Any:
    """``value`` with NaN / inf floats (also inside lists and dicts) replaced by None: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def results_document(measurement: "Measurement", meta: dict[str, Any]) -> dict[str, Any]:
    """The results file's content (see the module docstring)."""
    edges = histogram_edges([row.log_rho for row in measurement.rows], HISTOGRAM_BINS)
    rows = [{"label": row.label, "compression": to_dict(row.compression), "stats": row.stats,
             "histogram": histogram_counts(row.log_rho, edges), "samples": row.samples}
            for row in measurement.rows]
    return _finite({"format_version": FORMAT_VERSION, "command": "sparse-rl mismatch", "meta": meta,
                    "histogram_edges": edges.tolist(), "rows": rows})


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def build_table(document: dict[str, Any]):
    """A rich table: one row per study row (dense first), one column per ``COLUMNS`` entry (and ``MOE_COLUMNS`` when
    a row has them)."""
    from rich.table import Table

    meta = document["meta"]
    table = Table(title=f"rho = pi_old / pi_sparse on {meta['prompts']} prompts x {meta['samples_per_prompt']} "
                        f"samples, sampler seed {meta['sampler_seed']}", title_justify="left")
    columns = COLUMNS
    for extra in (MOE_COLUMNS, REPLAY_COLUMNS):
        if any(key in row["stats"] for row in document["rows"] for _, key, _ in extra):
            columns += extra
    table.add_column("KV cache", no_wrap=True)
    for header, _, _ in columns:
        table.add_column(header, justify="right")
    for row in document["rows"]:
        table.add_row(row["label"], *(_cell(row["stats"].get(key), fmt) for _, key, fmt in columns))
    return table


def dense_check(document: dict[str, Any]) -> tuple[bool, str]:
    """Whether the dense row's mean |log rho| stays within the weight-sync tolerance (the probe's statistic: a
    maximum over many tokens grows with their number under 16-bit rounding), and a line saying so."""
    dense = document["rows"][0]
    mean, tolerance = dense["stats"].get(MN.LOG_RHO_ABS_MEAN), document["meta"]["dense_tolerance"]
    if mean is None:
        return False, "dense: no response token to compare"
    if mean <= tolerance:
        return True, (f"dense: mean |log rho| {mean:.2g} <= {tolerance:g}: the engine and the learner agree without "
                      "compression, so the budget rows measure the compression alone")
    return False, (f"dense: mean |log rho| {mean:.2g} > {tolerance:g} (sync.probe_tolerance): the engine and the "
                   "learner disagree even without compression; every budget row includes that gap")


def plot_histograms(document: dict[str, Any], path: str | Path) -> Path:
    """One panel per row: log-rho histogram over the shared edges, log-scale counts, the correction's bounds
    (veto threshold, token rejection bounds) as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, edges = document["rows"], document["histogram_edges"]
    correction = document["meta"]["correction"]
    bounds = {"veto": correction.get("veto_threshold"), "lower": correction.get("rejection_lower"),
              "upper": correction.get("rejection_upper")}
    fig, axes = plt.subplots(len(rows), 1, figsize=(8, 1.9 * len(rows) + 0.6), sharex=True, squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        counts = row["histogram"]
        ax.stairs(counts, edges, fill=True, alpha=0.75)
        if any(counts):
            ax.set_yscale("log")
            ax.set_ylim(bottom=0.7)
        for name, rho in bounds.items():
            if rho and edges[0] <= math.log(rho) <= edges[-1]:
                ax.axvline(math.log(rho), color="tab:red" if name == "veto" else "tab:gray", ls="--", lw=0.8)
        stats = row["stats"]
        ax.set_title(f"{row['label']}: rho p1 {_cell(stats.get(MN.RHO_P1), '.3g')}, min "
                     f"{_cell(stats.get(MN.RHO_MIN), '.2g')}, rejected tokens "
                     f"{_cell(stats.get(MN.SPARSE_REJECTED_TOKEN_FRAC), '.3f')}", fontsize=9, loc="left")
        ax.set_ylabel("tokens")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("log rho = log pi_old - log pi_sparse  (dashed: rejection bounds, red: sequence veto)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
