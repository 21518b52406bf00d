"""The plugin's per-row record (``sglang_ext/row_state.py``) written into a request's ``meta`` when SGLang releases
the row. With SGLang's overlap scheduler a finished request rides one more decode forward, whose record is dropped
(``sync_meta(last_forward=False)``): the record is then the one before that forward, whether or not that forward
compressed the row. (A vectorised rewrite once left ``events`` at 0 when the dropped forward did not compress.)"""
import numpy as np
import torch

from sglang_ext.row_state import RowInfo, RowState
from sparse_rl_megatron.compression import CompressionConfig


def _state() -> tuple[RowState, RowInfo]:
    state = RowState(rows=2, width=8, num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=2, window=2,
                     max_candidates=8, ring_dtype=torch.float32, device="cpu", keep_queries=False,
                     keep_positions=False)
    info = RowInfo(config=CompressionConfig(method="rkv", budget=4, window=2, buffer=2), prompt_len=3,
                   meta={"events": 0, "peak_kv_tokens": 0, "kept_digest": None})
    state.reset(1, generation=0, info=info)
    return state, info


def _forward(state: RowState, *, compresses: bool, peak: int) -> None:
    rows = np.array([1])
    state.before_forward(rows)
    if compresses:
        state.events[1] += 1
    state.peak[1] = peak
    state.after_plan(rows)


def test_the_dropped_last_forward_keeps_the_record_before_it_whether_it_compressed_or_not():
    for last_compresses in (False, True):
        state, info = _state()
        _forward(state, compresses=True, peak=7)
        _forward(state, compresses=True, peak=7)
        _forward(state, compresses=last_compresses, peak=9)
        state.sync_meta(1, last_forward=False)
        assert (info.meta["events"], info.meta["peak_kv_tokens"]) == (2, 7), (last_compresses, info.meta)


def test_a_release_after_the_last_fed_forward_records_everything():
    state, info = _state()
    _forward(state, compresses=True, peak=7)
    _forward(state, compresses=False, peak=9)
    state.sync_meta(1, last_forward=True)
    assert (info.meta["events"], info.meta["peak_kv_tokens"]) == (1, 9)
