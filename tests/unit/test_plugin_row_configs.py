"""The plugin's interned per-row compressions (``RowState.configs``, ``sglang_ext/row_state.py``) stay bounded by the
rows bound: the adaptive budget gives requests many distinct per-request budgets, one config each, and before issue
41 every distinct one stayed in ``configs`` for the server's life."""
import torch

from sglang_ext.row_state import RowInfo, RowState
from sparse_rl_megatron.compression import CompressionConfig

ROWS = 4


def _info(budget: int) -> RowInfo:
    return RowInfo(config=CompressionConfig(method="rkv", budget=budget, window=2, buffer=2), prompt_len=3)


def test_configs_stay_bounded_by_the_rows_however_many_budgets_come():
    state = RowState(rows=ROWS, width=8, num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=2, window=2,
                     max_candidates=64, ring_dtype=torch.float32, device="cpu", keep_queries=False,
                     keep_positions=False)
    for request, budget in enumerate(range(3, 60)):   # 57 requests, each its own budget, through 4 rows
        row = request % ROWS
        state.reset(row, generation=request, info=_info(budget))
        assert state.configs[int(state.config_id[row])].budget == budget
        assert len(state.configs) <= ROWS
    # rows with one config share its id (they compress together); a config goes with its last row
    for row in range(ROWS):
        state.reset(row, generation=100 + row, info=_info(8))
    assert len(state.configs) == 1 and len(set(state.config_id.tolist())) == 1
    state.set_info(0, None)
    state.reset(1, generation=200, info=_info(9))
    assert sorted(c.budget for c in state.configs.values()) == [8, 9]
