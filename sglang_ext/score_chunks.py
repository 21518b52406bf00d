"""Chunks of a compression's (row, KV head) grid, so its transient memory does not grow with how many rows
compress at once.

A compressing step gathers every due row's candidate keys and values and scores them; R-KV's redundancy builds an
n x n similarity per row and KV head (with scope ``all`` and a long prompt, n is the prompt length), and a GRPO
batch reaches B + W together. The rows are taken ``mc`` at a time and, when one row's heads are already too
much, its KV heads ``h`` at a time, so that ``mc * (row_bytes + h * pair_bytes) <= SCORE_CHUNK_BYTES`` (or one
(row, head) pair, the least there is). The scorers treat every (row, KV head) independently, so the kept sets do
not depend on the chunking.
"""
from __future__ import annotations

SCORE_CHUNK_BYTES = 256 << 20
"""Transient bytes one chunk of a compression may use (gathered K/V, their float32 copies, the scorer's)."""


def score_chunks(rows: int, heads: int, *, pair_bytes: int, row_bytes: int,
                 budget: int = SCORE_CHUNK_BYTES) -> list[tuple[slice, list[slice]]]:
    """[(row slice, [KV-head slices])] covering ``rows x heads``. ``pair_bytes``: scorer bytes per (row, head);
    ``row_bytes``: the rest per row (its gathered K/V over all heads)."""
    per_head = max(1, min(heads, (budget - row_bytes) // max(pair_bytes, 1)))
    per_row = max(1, budget // max(row_bytes + per_head * pair_bytes, 1))
    head_slices = [slice(h, min(h + per_head, heads)) for h in range(0, heads, per_head)]
    return [(slice(r, min(r + per_row, rows)), head_slices) for r in range(0, rows, per_row)]
