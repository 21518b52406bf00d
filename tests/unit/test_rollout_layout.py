"""Where the rollout engines run (``rollout/layout.py``) and how a step's groups are shared out over them
(``rollout/work_split.py``): the one line every command prints is what starts."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.rollout.layout import LayoutError, RolloutLayout
from sparse_rl_megatron.rollout.work_split import describe_counts, group_cost, split_groups


def _layout(**kw):
    args = dict(engine="sglang", world=8, ranks_per_node=8, gpus_per_engine=1, groups=128, on_gpu=True)
    return RolloutLayout.build(**{**args, **kw})


@pytest.mark.parametrize("kw, line", [
    ({}, "rollout: 8 sglang engines x TP1 on ranks 0-7 (GPUs 0-7), 128 groups -> 16 per engine"),
    ({"gpus_per_engine": 2}, "rollout: 4 sglang engines x TP2 on ranks 0,2,4,6 (GPUs 0-1, 2-3, 4-5, 6-7), 128 groups "
                             "-> 32 per engine"),
    ({"world": 16}, "rollout: 16 sglang engines x TP1 on ranks 0-15 (2 nodes x GPUs 0-7), 128 groups -> 8 per engine"),
    ({"world": 32, "gpus_per_engine": 2}, "rollout: 16 sglang engines x TP2 on ranks 0-30 step 2 (4 nodes x GPUs 0-1, "
                                          "2-3, 4-5, 6-7), 128 groups -> 8 per engine"),
    ({"engine": "hf", "world": 2, "ranks_per_node": 1, "groups": 3, "on_gpu": False, "tensor_parallel": False},
     "rollout: 2 hf engines on ranks 0-1 (CPU), 3 groups -> 1-2 per engine"),
    ({"engine": "hf", "world": 2, "ranks_per_node": 2, "gpus_per_engine": 2, "groups": 3, "on_gpu": False,
      "tensor_parallel": False}, "rollout: 1 hf engine on rank 0 (one per 2 ranks, CPU), 3 groups -> 3 per engine"),
    ({"groups": 6}, "rollout: 8 sglang engines x TP1 on ranks 0-7 (GPUs 0-7), 6 groups -> 0-1 per engine "
                    "(2 engines idle)"),
    ({"ranks_per_node": 4, "urls": ["http://a:30000", "http://b:30000"], "on_gpu": False},
     "rollout: 2 sglang servers x TP1 at http://a:30000, http://b:30000, driven by ranks 0,4, 128 groups -> 64 per "
     "engine"),
    ({"world": 2, "ranks_per_node": 2, "urls": [f"http://h:{30000 + i}" for i in range(3)]},
     "rollout: 3 sglang servers x TP1 at 3 URLs (http://h:30000 ... http://h:30002), driven by ranks 0-1, 128 groups "
     "-> 42-43 per engine"),
])
def test_the_layout_line_says_what_starts(kw, line):
    assert _layout(**kw).describe() == line


def test_colocated_engines_use_their_groups_gpus_on_every_node():
    lay = _layout(world=16, gpus_per_engine=4)
    assert [(s.rank, s.ranks, s.node, s.gpus, s.base_gpu_id) for s in lay.slots] == [
        (0, (0, 1, 2, 3), 0, (0, 1, 2, 3), 0), (4, (4, 5, 6, 7), 0, (4, 5, 6, 7), 4),
        (8, (8, 9, 10, 11), 1, (0, 1, 2, 3), 0), (12, (12, 13, 14, 15), 1, (4, 5, 6, 7), 4)]
    assert lay.slots_of(4)[0].index == 1 and lay.slots_of(5) == () and lay.slots[1].ranks == (4, 5, 6, 7)
    cpu = _layout(world=2, ranks_per_node=2, on_gpu=False)
    assert [s.gpus for s in cpu.slots] == [(), ()] and cpu.slots[1].base_gpu_id == 0


def test_servers_are_driven_by_ranks_spread_over_the_nodes():
    lay = _layout(world=8, ranks_per_node=4, urls=[f"http://e{i}" for i in range(4)])
    assert [(s.rank, s.node, s.url) for s in lay.slots] == [(0, 0, "http://e0"), (2, 0, "http://e1"),
                                                             (4, 1, "http://e2"), (6, 1, "http://e3")]
    many = _layout(world=2, ranks_per_node=2, urls=[f"http://e{i}" for i in range(5)])
    assert [len(many.slots_of(r)) for r in (0, 1)] == [3, 2] and many.servers and many.slots[0].ranks == ()


@pytest.mark.parametrize("kw, message", [
    ({"gpus_per_engine": 3}, r"^rollout.gpus_per_engine=3 must divide the 8 rank\(s\) per node \(an engine's GPUs "
                             r"are on one node\); valid: 1, 2, 4, 8$"),
    ({"world": 2, "ranks_per_node": 1, "gpus_per_engine": 2}, r"^rollout.gpus_per_engine=2 must divide the 1 rank"),
    ({"gpus_per_engine": 0}, r"^rollout.gpus_per_engine must be >= 1, got 0$"),
])
def test_a_layout_that_cannot_start_is_one_line_naming_the_option(kw, message):
    with pytest.raises(LayoutError, match=message):
        _layout(**kw)


def test_groups_are_balanced_by_expected_tokens_and_never_split():
    costs = [group_cost(p, 8, 100) for p in (500, 20, 30, 480, 10, 40)]  # two long prompts, four short ones
    shares = split_groups(costs, 2)
    assert sorted(g for s in shares for g in s) == list(range(6)) and all(s == sorted(s) for s in shares)
    loads = [sum(costs[g] for g in s) for s in shares]
    assert (0 in shares[0]) != (3 in shares[0])  # the two long groups on different engines
    assert max(loads) - min(loads) <= max(costs)
    assert split_groups(costs, 2) == shares  # deterministic (the same split on every rank)
    assert [len(s) for s in split_groups([1.0] * 10, 4)] == [3, 3, 2, 2]
    assert split_groups([1.0] * 2, 3) == [[0], [1], []] and split_groups([], 2) == [[], []]
    assert describe_counts([3, 3, 2, 2]) == "2-3 per engine"
    assert describe_counts([1, 0]) == "0-1 per engine (1 engine idle)"
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_groups([1.0], 0)
