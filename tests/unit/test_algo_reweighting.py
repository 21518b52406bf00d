"""Importance weights (truncate / mask / clip) and global mean-1 normalisation independent of the split."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_rl_megatron.algo import importance_weights, normalisation_factor, normalise_weights, weight_stats
from sparse_rl_megatron.utils.registry import UnknownNameError

D = torch.float64
RHO = [0.4, 1.0, 2.0, 1.5, 0.5]


def _log_rho():
    return torch.tensor([[math.log(r) for r in RHO]], dtype=D)


def test_truncate_caps_at_upper_and_keeps_mask():
    w, m = importance_weights(_log_rho(), torch.tensor([[1, 1, 1, 1, 0]]))
    torch.testing.assert_close(w, torch.tensor([[0.4, 1.0, 1.5, 1.5, 0.0]], dtype=D))
    assert m.tolist() == [[True, True, True, True, False]]
    assert not w.requires_grad


def test_mask_mode_zeroes_and_drops_out_of_bounds_tokens():
    w, m = importance_weights(_log_rho(), torch.ones(1, 5), mode="mask", lower=0.5, upper=1.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0, 1.5, 0.5]], dtype=D))
    assert m.tolist() == [[False, True, False, True, True]]  # inclusive bounds; dropped from the mask


def test_clip_mode_clamps_both_sides():
    w, m = importance_weights(_log_rho(), torch.ones(1, 5), mode="clip", lower=0.5, upper=1.5)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 1.5, 1.5, 0.5]], dtype=D))
    assert m.all()


def test_weights_are_detached_even_from_grad_inputs():
    log_rho = _log_rho().requires_grad_()
    w, _ = importance_weights(log_rho, torch.ones(1, 5))
    assert not w.requires_grad


def test_normalisation_exact_values():
    w = torch.tensor([[0.5, 1.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    stats = weight_stats(w, mask)
    assert stats.dtype == torch.float64 and stats.tolist() == [1.5, 2.0]
    assert normalisation_factor(stats).item() == pytest.approx(4 / 3)
    torch.testing.assert_close(normalise_weights(w, mask, stats), torch.tensor([[2 / 3, 4 / 3, 0.0]], dtype=D))


def test_normalisation_safe_results_for_empty_batches():
    assert normalisation_factor(torch.tensor([0.0, 0.0], dtype=D)).item() == 1.0
    out = normalise_weights(torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([0.0, 0.0], dtype=D))
    assert torch.equal(out, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="not finite"):
        normalisation_factor(torch.tensor([float("nan"), 2.0], dtype=D))
    with pytest.raises(ValueError, match=r"\[sum, count\]"):
        normalisation_factor(torch.tensor([1.0], dtype=D))


def test_bad_mode_and_bounds():
    with pytest.raises(UnknownNameError, match="valid names: clip, mask, truncate"):
        importance_weights(_log_rho(), torch.ones(1, 5), mode="cap")
    with pytest.raises(ValueError, match="weight bounds"):
        importance_weights(_log_rho(), torch.ones(1, 5), upper=0.9)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.sampled_from([4, 8, 12]),
    length=st.integers(1, 7),
    num_micro=st.sampled_from([1, 2, 4]),
    mode=st.sampled_from(["truncate", "mask", "clip"]),
)
def test_normalised_weights_do_not_depend_on_the_split(seed, batch, length, num_micro, mode):
    g = torch.Generator().manual_seed(seed)
    log_rho = torch.randn(batch, length, generator=g, dtype=D) * 0.6
    mask = torch.rand(batch, length, generator=g) < 0.7
    w, m = importance_weights(log_rho, mask, mode=mode)
    full = normalise_weights(w, m, weight_stats(w, m))
    chunks = torch.arange(batch).chunk(num_micro)
    # each micro-batch computes local stats; the caller sums them (all-reduce over micro-batches / ranks)
    global_stats = sum(weight_stats(w[c], m[c]) for c in chunks)
    split = torch.cat([normalise_weights(w[c], m[c], global_stats) for c in chunks])
    torch.testing.assert_close(split, full, rtol=1e-13, atol=1e-13)
    if int(m.sum()):
        assert full[m].mean().item() == pytest.approx(1.0, rel=1e-12)
