"""Advantage estimators: exact values, computed over kept samples only."""
import math

import pytest
import torch

from sparse_rl_megatron.algo import compute_advantages
from sparse_rl_megatron.utils.registry import UnknownNameError

D = torch.float64
EPS = 1e-6
R = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D)
G = torch.tensor([0, 0, 0, 0])


def test_grpo_uses_unbiased_group_std():
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1, 0]: sqrt(4 * 0.25 / 3)
    expected = torch.tensor([0.5, -0.5, 0.5, -0.5], dtype=D) / (std + EPS)
    torch.testing.assert_close(compute_advantages(R, G), expected, rtol=1e-15, atol=0)


def test_drgrpo_rloo_reinforce():
    torch.testing.assert_close(compute_advantages(R, G, estimator="drgrpo"), torch.tensor([0.5, -0.5, 0.5, -0.5], dtype=D))
    torch.testing.assert_close(compute_advantages(R, G, estimator="rloo"), torch.tensor([2, -2, 2, -2], dtype=D) / 3)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0], dtype=D)
    groups = torch.tensor([0, 0, 0, 0, 1, 1])  # reinforce ignores groups: baseline = 4/6
    torch.testing.assert_close(
        compute_advantages(rewards, groups, estimator="reinforce"),
        torch.tensor([1, -2, 1, -2, 1, 1], dtype=D) / 3,
    )


def test_groups_are_found_by_id_not_position():
    rewards = torch.tensor([1.0, 3.0, 0.0, 5.0], dtype=D)
    groups = torch.tensor([7, 3, 7, 3])  # groups {0, 2} and {1, 3}, unsorted ids
    torch.testing.assert_close(compute_advantages(rewards, groups, estimator="drgrpo"),
                               torch.tensor([0.5, -1.0, -0.5, 1.0], dtype=D))


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce"])
def test_dropped_sample_does_not_change_the_others(estimator):
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=D)
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    keep = torch.tensor([True, True, True, False, True, True])
    with_drop = compute_advantages(rewards, groups, keep, estimator=estimator)
    # the same estimator on the batch WITHOUT sample 3 at all
    without = compute_advantages(rewards[keep], groups[keep], estimator=estimator)
    torch.testing.assert_close(with_drop[keep], without, rtol=0, atol=0)
    assert with_drop[3].item() == 0.0
    # and changing the dropped sample's reward changes nothing (even to NaN: it is never read)
    rewards2 = rewards.clone()
    rewards2[3] = float("nan")
    assert torch.equal(compute_advantages(rewards2, groups, keep, estimator=estimator), with_drop)


def test_grpo_after_veto_exact():
    keep = torch.tensor([True, True, True, False])
    std = math.sqrt(1 / 3)  # kept rewards [1, 0, 1]: mean 2/3, unbiased var ((1/3)^2*2 + (2/3)^2)/2 = 1/3
    expected = torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.0], dtype=D) / (std + EPS)
    expected[3] = 0.0
    torch.testing.assert_close(compute_advantages(R, G, keep), expected, rtol=1e-15, atol=0)


def test_single_kept_sample_and_constant_groups_give_zero_not_nan():
    keep = torch.tensor([True, False, False, False])
    for est in ["grpo", "drgrpo", "rloo", "reinforce"]:
        assert compute_advantages(R, G, keep, estimator=est).tolist() == [0.0] * 4
    same = torch.ones(4, dtype=D)
    assert compute_advantages(same, G).tolist() == [0.0] * 4
    nothing = compute_advantages(R, G, torch.zeros(4, dtype=torch.bool))
    assert nothing.tolist() == [0.0] * 4


def test_dtypes_and_bad_input():
    assert compute_advantages(torch.tensor([1, 0]), torch.tensor([0, 0])).dtype == torch.float32
    assert compute_advantages(R.float(), G).dtype == torch.float32
    with pytest.raises(UnknownNameError, match="valid names: drgrpo, grpo, reinforce, rloo"):
        compute_advantages(R, G, estimator="ppo")
    with pytest.raises(ValueError, match=r"group_ids must have shape \[B\] = \(4,\)"):
        compute_advantages(R, torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="integer"):
        compute_advantages(R, G.double())
    with pytest.raises(ValueError, match=r"finite for kept samples; rewards\[1\]"):
        compute_advantages(torch.tensor([1.0, float("inf")]), torch.tensor([0, 0]))
