"""Sparsity-aware rejection: veto, token bounds, levels, keys; a NEW mask, inputs untouched."""
import math

import pytest
import torch

from sparse_rl_megatron.algo import reject, sequence_veto
from sparse_rl_megatron.utils.registry import UnknownNameError

D = torch.float64


def lr(*rhos):
    return [math.log(r) for r in rhos]


def test_reference_defaults_token_bounds_and_veto():
    log_rho = torch.tensor([lr(1.0, 0.4, 1.6, 1.5), lr(1.0, 5e-5, 1.0, 1.0), [0.0] * 4], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]])
    mask_before = mask.clone()
    res = reject(log_rho, mask)
    assert torch.equal(mask, mask_before)  # input untouched
    assert res.mask.tolist() == [[True, False, False, True], [False] * 4, [False] * 4]  # 1.5 inclusive
    assert res.keep.tolist() == [True, False, False]
    assert res.vetoed.tolist() == [False, True, False]
    # bounds are checked before the veto: sample 1's token with rho 5e-5 is also below 0.5
    assert res.out_of_bounds.tolist() == [[False, True, True, False], [False, True, False, False], [False] * 4]


def test_veto_only_looks_at_masked_tokens_and_can_be_disabled():
    log_rho = torch.tensor([lr(1.0, 1e-6)], dtype=D)
    assert sequence_veto(log_rho, torch.tensor([[1, 0]])).tolist() == [False]  # the tiny rho is padding
    assert sequence_veto(log_rho, torch.tensor([[1, 1]])).tolist() == [True]
    assert sequence_veto(log_rho, torch.tensor([[1, 1]]), None).tolist() == [False]
    assert sequence_veto(log_rho, torch.tensor([[1, 1]]), 1e-7).tolist() == [False]
    with pytest.raises(ValueError, match="veto threshold"):
        sequence_veto(log_rho, torch.tensor([[1, 1]]), 2.0)


def test_sequence_level_uses_product_of_ratios():
    # sample 0: 2.0 * 0.5 = 1 kept (token 2.0 would be rejected at token level); sample 1: 1.2 * 1.3 = 1.56 > 1.5
    log_rho = torch.tensor([lr(2.0, 0.5), lr(1.2, 1.3)], dtype=D)
    res = reject(log_rho, torch.ones(2, 2), level="sequence", veto_threshold=None)
    assert res.mask.tolist() == [[True, True], [False, False]]
    assert res.keep.tolist() == [True, False]


def test_geometric_level_uses_mean_log_ratio():
    # sample 0: sqrt(1.56) = 1.249 kept; sample 1: sqrt(0.3 * 0.6) = 0.424 < 0.5 rejected;
    # sample 2: the padded token (rho 0.01) is not part of the mean -> 1.0 kept
    log_rho = torch.tensor([lr(1.2, 1.3), lr(0.3, 0.6), lr(1.0, 0.01)], dtype=D)
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    res = reject(log_rho, mask, level="geometric", veto_threshold=None)
    assert res.mask.tolist() == [[True, True], [False, False], [True, False]]


def test_k2_and_k3_keys_with_max_divergence():
    log_rho = torch.tensor([[0.3, 0.4, -0.35, -0.3, 0.31]], dtype=D)
    # k2 = x^2/2: 0.045, 0.08, 0.06125, 0.045, 0.04805
    k2 = reject(log_rho, torch.ones(1, 5), key="k2", max_divergence=0.05, veto_threshold=None)
    assert k2.mask.tolist() == [[True, False, False, True, True]]
    # k3 = e^x - 1 - x: 0.049859, 0.091825, 0.054688, 0.040818, 0.053425
    k3 = reject(log_rho, torch.ones(1, 5), key="k3", max_divergence=0.05, veto_threshold=None)
    assert k3.mask.tolist() == [[True, False, False, True, False]]
    # sequence-level k3 sums the per-token values: 0.049859 + 0.040818 = 0.0907 <= 0.1 kept
    seq = reject(log_rho[:, [0, 3]], torch.ones(1, 2), key="k3", level="sequence", max_divergence=0.1,
                 veto_threshold=None)
    assert seq.mask.tolist() == [[True, True]]


def test_k1_custom_bounds():
    log_rho = torch.tensor([lr(0.85, 0.95, 1.05, 1.2)], dtype=D)
    res = reject(log_rho, torch.ones(1, 4), lower=0.9, upper=1.1, veto_threshold=None)
    assert res.mask.tolist() == [[False, True, True, False]]


def test_unknown_names_and_bad_bounds():
    log_rho, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(UnknownNameError, match="valid names: geometric, sequence, token"):
        reject(log_rho, mask, level="sentence")
    with pytest.raises(UnknownNameError, match="valid names: k1, k2, k3"):
        reject(log_rho, mask, key="k4")
    with pytest.raises(ValueError, match="lower <= 1 <= upper"):
        reject(log_rho, mask, lower=1.2, upper=1.5)
    with pytest.raises(ValueError, match="max_divergence"):
        reject(log_rho, mask, key="k3", max_divergence=-1.0)
    with pytest.raises(ValueError, match="0/1"):
        reject(log_rho, torch.tensor([[1, 2]]))
