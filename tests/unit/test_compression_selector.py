"""Selector: top (B - alpha) by score + the alpha newest, per head, ascending, deterministic ties."""
import torch

from sparse_rl_megatron.compression import gather_kept, select_kept


def test_top_scores_plus_window_in_original_order():
    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.7, 0.2], [0.8, 0.1, 0.2, 0.3, 0.9]]])  # 2 heads, N - alpha = 5
    kept = select_kept(scores, budget=4, window=2)  # N = 7: window = indices 5, 6
    assert kept.tolist() == [[[1, 3, 5, 6], [0, 4, 5, 6]]]


def test_ties_prefer_newer_token_and_nan_ranks_last():
    scores = torch.tensor([[[1.0, 1.0, 1.0, 0.0]]])
    assert select_kept(scores, budget=3, window=1).tolist() == [[[1, 2, 4]]]
    scores = torch.tensor([[[float("nan"), 0.0, -5.0]]])
    assert select_kept(scores, budget=3, window=1).tolist() == [[[1, 2, 3]]]
    inf = float("inf")
    scores = torch.tensor([[[inf, inf, 0.0, 1.0, 2.0]]])  # StreamingLLM-like sinks
    assert select_kept(scores, budget=4, window=1).tolist() == [[[0, 1, 4, 5]]]


def test_selection_is_independent_per_head_and_row():
    torch.manual_seed(0)
    scores = torch.randn(3, 4, 20)
    kept = select_kept(scores, budget=6, window=2)
    for b in range(3):
        for h in range(4):
            top = torch.topk(scores[b, h], 4).indices.sort().values.tolist()
            assert kept[b, h].tolist() == top + [20, 21]


def test_gather_kept_per_head():
    x = torch.arange(2 * 2 * 5 * 3, dtype=torch.float32).reshape(2, 2, 5, 3)
    kept = torch.tensor([[[0, 4], [1, 2]], [[3, 4], [0, 1]]])
    out = gather_kept(x, kept)
    for b in range(2):
        for h in range(2):
            torch.testing.assert_close(out[b, h], x[b, h, kept[b, h]])
    pos = torch.arange(5).expand(2, 2, 5)
    assert gather_kept(pos.unsqueeze(-1), kept).squeeze(-1).tolist() == kept.tolist()
