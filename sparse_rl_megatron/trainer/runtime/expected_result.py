"""The last line of a run whose recipe documents its result (``TrainConfig.expect``): inside the range or not.

The embedded default's result is stated as a range over seeds and kernel paths (docs/embedded-default.md); a
user's run says whether it landed there, so a run that looks different says so itself instead of looking broken.
"""
from __future__ import annotations

from typing import Any, Sequence

from sparse_rl_megatron.trainer.config import ExpectConfig

NEUTRAL_OVERRIDES = ("run_dir", "seed", "log.", "checkpoint.", "phase_timeout_s", "plugins", "expect.")
"""Command-line keys that leave a recipe's documented result applicable (a seed is one more draw of it)."""


def overridden_keys(overrides: Sequence[str]) -> list[str]:
    """The keys of ``key=value`` overrides that change what a recipe's documented result is about."""
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    return [k for k in keys if not any(k == n or (n.endswith(".") and k.startswith(n)) for n in NEUTRAL_OVERRIDES)]


def expected_result_line(expect: ExpectConfig | None, records: Sequence[dict[str, Any]]) -> str | None:
    """One line comparing the run's metrics at ``expect.step`` with ``expect.ranges``; None without ranges."""
    if expect is None or not expect.ranges:
        return None
    source = f" ({expect.source})" if expect.source else ""
    at = next((r for r in records if r.get("step") == expect.step and all(k in r for k in expect.ranges)), None)
    if at is None:
        return (f"documented result{source}: for step {expect.step}, which this run did not evaluate; "
                f"nothing to compare")
    parts, inside = [], True
    for key, (low, high) in expect.ranges.items():
        value = float(at[key])
        ok = low <= value <= high
        inside &= ok
        parts.append(f"{key} {value:.3f} {'in' if ok else 'OUTSIDE'} [{low:.3f}, {high:.3f}]")
    verdict = "inside the documented range" if inside else "OUTSIDE the documented range"
    line = f"documented result{source} at step {expect.step}: {'; '.join(parts)}: {verdict}"
    if expect.overridden:
        line += f" (the range is the recipe's as written; this run changed {', '.join(expect.overridden)})"
    return line
