"""Rich tables: one per benchmark of a results file, a summary, and two results files side by side."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

_REASONS = ("correct", "wrong", "no_answer", "timeout", "parse_error")


def sampling_label(temperature: float, top_p: float) -> str:
    """The sampling in effect: ``greedy`` at temperature 0 (top-p plays no part), else ``T=<t>`` with
    ``top-p=<p>`` when p < 1 (when it filters)."""
    if temperature == 0:
        return "greedy"
    return f"T={temperature}" + (f" top-p={top_p}" if top_p < 1.0 else "")


def _score_keys(metrics: dict[str, Any]) -> list[str]:
    avg = [k for k in metrics if k.startswith("avg@")]
    passes = sorted((k for k in metrics if k.startswith("pass@")), key=lambda k: int(k.split("@")[1]))
    return avg + passes


def _metric_rows(bench: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(label, value, format) rows of one benchmark: scores in %, reasons in % of samples, lengths."""
    m = bench["metrics"]
    rows = [(k, 100.0 * m[k], "{:.2f}") for k in _score_keys(m)]
    if "shortcut_free_accuracy" in m:  # the records whose answer is none of the prompt's values
        rows += [(f"shortcut-free avg@{bench['n']} ({int(m['shortcut_free_problems'])} problems)",
                  100.0 * m["shortcut_free_accuracy"], "{:.2f}")]
    if "full_chain_frac" in m:  # chain tasks: every intermediate state right
        rows += [("fully correct chains %", 100.0 * m["full_chain_frac"], "{:.2f}")]
    samples = max(m["samples"], 1)
    rows += [(f"{r} %", 100.0 * m["reasons"].get(r, 0) / samples, "{:.1f}") for r in _REASONS]
    rows += [("mean response tokens", m["mean_response_tokens"], "{:.1f}"),
             ("truncated %", 100.0 * m["truncated_fraction"], "{:.1f}"),
             ("compression events / sample", m["mean_compression_events"], "{:.2f}")]
    return rows


def print_results(results: dict[str, Any], console: Console | None = None) -> None:
    """A table per benchmark, then one summary line per benchmark."""
    console = console or Console()
    meta = results["meta"]
    console.print(f"[bold]{meta['model']}[/bold]  engine={meta['engine']}  mode={meta['mode']}  "
                  f"{sampling_label(meta['temperature'], meta['top_p'])}  template={meta['template']}")
    for name, bench in results["benchmarks"].items():
        m = bench["metrics"]
        table = Table(title=f"{name}: {m['problems']} problems x n={bench['n']}, "
                            f"max {bench['max_new_tokens']} tokens")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for label, value, fmt in _metric_rows(bench):
            table.add_row(label, fmt.format(value))
        console.print(table)
    summary = Table(title=f"summary ({meta['mode']})")
    for col in ("benchmark", "problems", "n", "avg@n %", "shortcut-free %", "no answer %", "truncated %",
                "generate s", "verify s"):
        summary.add_column(col, justify="left" if col == "benchmark" else "right")
    for name, bench in results["benchmarks"].items():
        m = bench["metrics"]
        avg = m[f"avg@{bench['n']}"]
        free = f"{100 * m['shortcut_free_accuracy']:.2f}" if "shortcut_free_accuracy" in m else "-"
        summary.add_row(name, str(m["problems"]), str(bench["n"]), f"{100 * avg:.2f}", free,
                        f"{100 * m['reasons']['no_answer'] / max(m['samples'], 1):.1f}",
                        f"{100 * m['truncated_fraction']:.1f}", f"{bench['seconds']['generate']:.1f}",
                        f"{bench['seconds']['verify']:.1f}")
    console.print(summary)


def problem_agreement(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int]:
    """Per problem (matched by source id): is A's accuracy higher, lower or equal to B's?"""
    acc_b = {p["source_id"]: p["correct"] / max(len(p["samples"]), 1) for p in b["problems"]}
    out = {"a_better": 0, "b_better": 0, "tie": 0, "unmatched": 0}
    for p in a["problems"]:
        if p["source_id"] not in acc_b:
            out["unmatched"] += 1
            continue
        acc_a = p["correct"] / max(len(p["samples"]), 1)
        key = "tie" if acc_a == acc_b[p["source_id"]] else ("a_better" if acc_a > acc_b[p["source_id"]] else "b_better")
        out[key] += 1
    return out


def print_comparison(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str] = ("A", "B"),
                     console: Console | None = None) -> None:
    """Two results files side by side, per benchmark: every metric of both, the difference, and per-problem wins."""
    console = console or Console()
    la, lb = labels
    console.print(f"[bold]{la}[/bold] = {a['meta']['model']} ({a['meta']['mode']})")
    console.print(f"[bold]{lb}[/bold] = {b['meta']['model']} ({b['meta']['mode']})")
    common = [n for n in a["benchmarks"] if n in b["benchmarks"]]
    only = sorted(set(a["benchmarks"]) ^ set(b["benchmarks"]))
    for name in common:
        ba, bb = a["benchmarks"][name], b["benchmarks"][name]
        table = Table(title=f"{name}: {la} n={ba['n']} vs {lb} n={bb['n']}")
        for col in ("metric", la, lb, f"{lb} - {la}"):
            table.add_column(col, justify="left" if col == "metric" else "right")
        rows_b = {label: value for label, value, _ in _metric_rows(bb)}
        for label, value, fmt in _metric_rows(ba):
            if label in rows_b:
                table.add_row(label, fmt.format(value), fmt.format(rows_b[label]),
                              ("{:+" + fmt[2:]).format(rows_b[label] - value))
            else:
                table.add_row(label, fmt.format(value), "-", "-")
        agree = problem_agreement(ba, bb)
        table.add_row("problems with higher accuracy", str(agree["a_better"]), str(agree["b_better"]),
                      f"{agree['tie']} tied")
        console.print(table)
    if only:
        console.print(f"benchmarks in only one file (not compared): {', '.join(only)}")
