"""``results.json`` and ``results.md`` from the records written so far (rewritten after every part).

The markdown has the run's header, one line per part (status, seconds, box), then one table per part with
an item per row and its metrics as columns (nested metrics flattened as ``a.b``; long strings, like a
traceback, only in the JSON).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from gpu_kit.records import read_records

STATUS_ITEM = "_status"
"""The item name of the driver's own record of a part (status, seconds, box)."""
_HIDDEN = {"part", "item", "traceback", "cum_s"}
_MAX_CELL = 90


def _flat(metrics: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    text = str(v).replace("|", "/").replace("\n", " ")
    return text if len(text) <= _MAX_CELL else text[:_MAX_CELL - 3] + "..."


def _find(records: list[dict], part: str, prefix: str) -> dict | None:
    for r in records:
        if r["part"] == part and r["item"].startswith(prefix) and r.get("ok"):
            return r
    return None


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else (f"{v:.{digits}g}" if isinstance(v, float) else str(v))


def summary(records: list[dict]) -> list[tuple[str, str]]:
    """The headline numbers (what | measured), from whichever items finished."""
    rows: list[tuple[str, str]] = []
    for dtype in ("float32", "bfloat16"):
        r = _find(records, "logprobs", f"learner {dtype}")
        if r:
            extra = f"; vs HF fp32 max {_fmt(r['vs_hf_fp32']['max_abs'])}" if "vs_hf_fp32" in r else ""
            rows.append((f"log-probs, learner {dtype} vs HF {dtype}",
                         f"max abs {_fmt(r['max_abs'])}, mean abs {_fmt(r['mean_abs'])} ({r['tokens']} tokens){extra}"))
    for call in ("logprobs", "train_step"):
        a, b = _find(records, "lm_head_memory", f"{call}, LM head chunked"), _find(
            records, "lm_head_memory", f"{call}, LM head unchunked")
        if a and b:
            rows.append((f"{call} peak memory, LM head chunked vs unchunked",
                         f"{_fmt(a['peak_rise_gib'])} vs {_fmt(b['peak_rise_gib'])} GiB "
                         f"(x{_fmt(a['peak_rise_bytes'] / max(b['peak_rise_bytes'], 1), 2)})"))
    for part in ("train", "train_recompute"):
        for prefix in ("log-probs", "train step"):
            r = _find(records, part, prefix)
            if r:
                mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
                rows.append((f"{r['item']}" + (" [recompute learner]" if part == "train_recompute" and
                                               prefix == "log-probs" else ""),
                             f"{_fmt(r['tokens_per_s'], 5)} tok/s{mfu} ({r['tokens']} tokens per call)"))
    r = _find(records, "train", "checkpoint")
    if r:
        rows.append(("checkpoint save + load (distributed optimizer)",
                     f"save {r['save_s']} s, load {r['load_s']} s, {r['size_gib']} GiB; weights and a replayed "
                     f"step restored (max diff {_fmt(r['restored_max_abs'])}, {_fmt(r['replayed_step_max_abs'])})"))
    for method in ("dense", "rkv", "snapkv"):
        r = _find(records, "engine", f"decode {method}")
        if r:
            done = "" if r.get("complete") else f" (stopped at step {r['decode_steps']} of {r['response']})"
            rows.append((f"engine decode, {method}, {r['rows']} x {r['response']} tokens",
                         f"{_fmt(r['decode_tok_s'], 5)} tok/s (last 1/8: {_fmt(r.get('end_tok_s'), 5)}), peak "
                         f"{_fmt(r.get('peak_mib_per_seq'))} MiB/seq, fits {_fmt(r.get('fits_in_budget'))} in the "
                         f"budget{done}"))
    return rows


def _groups(items: list[dict]) -> list[list[tuple[dict, dict]]]:
    """Consecutive items with the same metric names share a table."""
    groups: list[list[tuple[dict, dict]]] = []
    for r in items:
        row = _flat({k: v for k, v in r.items() if k not in _HIDDEN})
        if groups and list(groups[-1][0][1]) == list(row):
            groups[-1].append((r, row))
        else:
            groups.append([(r, row)])
    return groups


def markdown(header: dict, records: list[dict]) -> str:
    lines = [f"# GPU check: {header.get('preset')}", ""]
    lines += [f"- {k}: {_cell(v)}" for k, v in header.items()]
    statuses = [r for r in records if r["item"] == STATUS_ITEM]
    lines += ["", "| part | status | seconds | limit s |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {r['part']} | {r['status']} | {_cell(r.get('seconds'))} | {_cell(r.get('box_s'))} |"
              for r in statuses]
    headline = summary(records)
    if headline:
        lines += ["", "## At a glance", "", "| what | measured |", "| --- | --- |"]
        lines += [f"| {what} | {value} |" for what, value in headline]
    for part in dict.fromkeys(r["part"] for r in records):
        items = [r for r in records if r["part"] == part and r["item"] != STATUS_ITEM]
        if items:
            lines += ["", f"## {part}"]
        for group in _groups(items):
            if len(group) == 1:  # one item: a metric per line reads better than a very wide row
                r, row = group[0]
                lines += ["", f"| {r['item']} | |", "| --- | --- |"]
                lines += [f"| {k} | {_cell(v)} |" for k, v in row.items()]
                continue
            columns = list(group[0][1])
            lines += ["", "| item | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
            lines += [f"| {r['item']} | " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for r, row in group]
    return "\n".join(lines) + "\n"


def write(out_dir: str | os.PathLike, header: dict) -> tuple[Path, Path]:
    """Write both files from ``out_dir/records.jsonl``; returns their paths."""
    out = Path(out_dir)
    records = read_records(out)
    js, md = out / "results.json", out / "results.md"
    js.write_text(json.dumps(dict(header=header, records=records), indent=1) + "\n")
    md.write_text(markdown(header, records))
    return js, md
