"""Rows -> data-parallel shards -> token-budgeted micro-batches -> model inputs (hand-worked, in-process)."""
import torch

from sparse_rl_megatron.learner.batch import SequenceBatch, build_micro_batch, plan_micro_batches, split_rows


def test_split_rows_balances_tokens_and_covers_every_row():
    lengths = [10, 9, 3, 2, 8]
    parts = split_rows(lengths, 2)
    assert parts == [[0, 2, 3], [1, 4]]  # 10+3+2 = 15 vs 9+8 = 17 (longest first to the lighter rank)
    assert sorted(i for p in parts for i in p) == list(range(5))
    assert split_rows([1, 1], 2) == [[0], [1]]


def test_split_rows_with_fewer_rows_than_ranks_leaves_the_last_ranks_empty():
    # the weight-sync probe (one row) at DP = 2 used to raise "cannot split 1 rows over 2 data-parallel ranks"
    assert split_rows([7], 2) == [[0], []]
    assert split_rows([3, 9], 4) == [[1], [0], [], []]
    assert split_rows([], 2) == [[], []]


def test_padded_micro_batches_respect_rows_times_longest():
    assert plan_micro_batches([10, 9, 3, 2], [0, 1, 2, 3], 20, "padded") == [[0, 1], [2, 3]]
    assert plan_micro_batches([30, 2], [0, 1], 20, "padded") == [[0], [1]]  # over-long row alone


def test_packed_micro_batches_first_fit_decreasing():
    assert plan_micro_batches([10, 9, 3, 2], [0, 1, 2, 3], 12, "packed") == [[0, 3], [1, 2]]


def test_padded_inputs_and_gather_plan():
    b = SequenceBatch.from_lists([[1, 2], [3]], [[4, 5, 6], [7]])
    assert b.lengths == [4, 1] and b.max_response_len == 3
    assert b.response_mask().tolist() == [[True, True, True], [True, False, False]]
    mb = build_micro_batch(b, [0, 1], "padded")
    assert mb.input_ids.tolist() == [[1, 2, 4, 5], [3, 0, 0, 0]]
    assert mb.attention_mask() is None
    assert mb.gather_index.tolist() == [1, 2, 3, 4]  # row 0 positions 1..3, row 1 position 0 (flat 4)
    assert mb.labels.tolist() == [4, 5, 6, 7]
    assert mb.out_row.tolist() == [0, 0, 0, 1] and mb.out_col.tolist() == [0, 1, 2, 0]


def test_packed_inputs_block_causal_mask():
    b = SequenceBatch.from_lists([[1, 2], [3]], [[4, 5, 6], [7]])
    mb = build_micro_batch(b, [0, 1], "packed")
    assert mb.input_ids.tolist() == [[1, 2, 4, 5, 3]] and mb.position_ids.tolist() == [[0, 1, 2, 3, 0]]
    assert mb.gather_index.tolist() == [1, 2, 3, 4]
    allowed = ~mb.attention_mask()[0, 0]
    expected = torch.zeros(5, 5, dtype=torch.bool)
    expected[:4, :4] = torch.ones(4, 4, dtype=torch.bool).tril()
    expected[4, 4] = True
    assert torch.equal(allowed, expected)


def test_packed_mask_is_built_only_for_the_forward_that_reads_it(monkeypatch):
    """The dense [S, S] mask of a packed micro-batch (256 MiB at 16k tokens) is not built with the micro-batch:
    the THD path (Transformer Engine) never builds it, the local path builds it when its forward runs."""
    from sparse_rl_megatron.learner import batch as batch_mod
    from sparse_rl_megatron.learner.forward import model_inputs

    built = []
    real = batch_mod._block_causal_mask
    monkeypatch.setattr(batch_mod, "_block_causal_mask", lambda lengths: built.append(list(lengths)) or real(lengths))
    b = SequenceBatch.from_lists([[1, 2], [3]], [[4, 5, 6], [7]])
    mbs = [build_micro_batch(b, [0, 1], "packed"), build_micro_batch(b, [1], "packed")]
    assert built == []
    thd = model_inputs(mbs[0], use_thd=True)
    assert built == [] and thd["attention_mask"] is None
    assert thd["packed_seq_params"].cu_seqlens_q.tolist() == [0, 4, 5]
    local = model_inputs(mbs[0], use_thd=False)
    assert built == [[4, 1]] and local["attention_mask"].shape == (1, 1, 5, 5)


def test_lengths_padded_to_a_multiple_for_sequence_parallel():
    """Sequence parallel splits S over the TP ranks: padded rows widen to a multiple, a packed sequence gets a
    padding block of its own; what is gathered (positions, labels) does not change."""
    b = SequenceBatch.from_lists([[1, 2], [3]], [[4, 5, 6], [7]])  # fed lengths 4 and 1
    padded = build_micro_batch(b, [0, 1], "padded", multiple=3)
    assert padded.input_ids.tolist() == [[1, 2, 4, 5, 0, 0], [3, 0, 0, 0, 0, 0]]
    assert padded.gather_index.tolist() == [1, 2, 3, 6]  # row 1 starts at 6 now
    packed = build_micro_batch(b, [0, 1], "packed", multiple=4)
    assert packed.input_ids.tolist() == [[1, 2, 4, 5, 3, 0, 0, 0]] and packed.pad_tokens == 3
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 0, 1, 2]] and packed.segments() == [4, 1, 3]
    assert packed.gather_index.tolist() == [1, 2, 3, 4] and packed.labels.tolist() == [4, 5, 6, 7]
    allowed = ~packed.attention_mask()[0, 0]
    assert allowed[5:, :5].sum() == 0 and allowed[:5, 5:].sum() == 0  # the padding is a block of its own
    assert build_micro_batch(b, [0, 1], "packed", multiple=5).pad_tokens == 0


def test_padding_mask_and_real_tokens_leave_out_padding_and_stand_ins():
    """What the routers' load-balancing statistics leave out (True = padding): padded rows' right-padding, the
    packed padding block, every token of a stand-in; ``real_tokens`` counts the rest (``num_tokens`` counts all)."""
    from sparse_rl_megatron.learner.batch import padding_micro_batch

    b = SequenceBatch.from_lists([[1, 2], [3]], [[4, 5, 6], [7]])  # fed lengths 4 and 1
    padded = build_micro_batch(b, [0, 1], "padded", multiple=3)
    assert padded.padding_mask().tolist() == [[False] * 4 + [True] * 2, [False] + [True] * 5]
    assert (padded.num_tokens, padded.real_tokens) == (12, 5)
    packed = build_micro_batch(b, [0, 1], "packed", multiple=4)
    assert packed.padding_mask().tolist() == [[False] * 5 + [True] * 3]
    assert (packed.num_tokens, packed.real_tokens) == (8, 5)
    stand_in = padding_micro_batch(b, "padded")
    assert stand_in.padding_mask().tolist() == [[True] * 4] and (stand_in.num_tokens, stand_in.real_tokens) == (4, 0)


def test_sequence_parallel_chunk_of_the_padding_mask():
    """A later pipeline stage under sequence parallel gets its TP rank's contiguous S / tp positions of the mask
    (megatron-core 0.16 scatters it on the first stage only); S must divide."""
    import pytest

    from sparse_rl_megatron.learner.forward import sequence_parallel_chunk

    mask = torch.tensor([[False, False, False, True, True, True], [False, True, True, True, True, True]])
    assert sequence_parallel_chunk(mask, 2, 0).tolist() == [[False, False, False], [False, True, True]]
    assert sequence_parallel_chunk(mask, 2, 1).tolist() == [[True, True, True], [True, True, True]]
    assert torch.equal(torch.cat([sequence_parallel_chunk(mask, 3, r) for r in range(3)], 1), mask)
    with pytest.raises(ValueError, match="divisible by TP = 4"):
        sequence_parallel_chunk(mask, 4, 0)
