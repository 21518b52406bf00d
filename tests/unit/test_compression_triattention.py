"""TriAttention (arXiv 2604.04921): exact small cases, and kept sets equal to the authors' algorithm.

The reference below follows the authors' code (github.com/WeianMao/triattention: ``pruning_utils.invert_rope``,
``compute_frequency_statistics_from_means``, ``score_keys_for_round`` with mean aggregation, ``normalize_scores``,
``_select_per_layer_perhead_independent`` with max aggregation) step by step, in loops over heads, tokens,
frequencies and offsets: keys are un-rotated with their own positions, the phase is ``atan2`` of
``E q_f conj(k_f)``, each future offset is a separate cosine sum. Our implementation never un-rotates a key (a
virtual query dotted with the post-RoPE key); the two must still keep the same tokens. The one deliberate
difference: our selector always keeps the alpha newest (the observation window), so the reference does too.
"""
import math

import pytest
import torch

from sparse_rl_megatron.compression import (
    CompressionConfig, ScoreInputs, center_sums, choose_kept, get_scorer, triattention_logits, unrotate,
)
from sparse_rl_megatron.rollout.hf_forward import _apply_rope


def _rotate(pre: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE of [..., T, D] with positions [..., T] (what the engines cache)."""
    angle = positions.double().unsqueeze(-1) * inv_freq.double()
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1)
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1)
    half = pre.shape[-1] // 2
    rot = torch.cat([-pre[..., half:], pre[..., :half]], dim=-1)
    return (pre.double() * cos + rot.double() * sin).to(pre.dtype)


# ----------------------------------------------------------------------------- hand-computed values
def test_trig_term_exact_with_quarter_turn_frequency():
    # One pair, omega = pi/2, one offset (d = 1). Center E q = 1 (real), E|q| = 1 (no norm term). Pre-RoPE key 1
    # at positions 0..3, next position t = 4: score = cos(pi/2 (t - p + 1)) = cos(5pi/2), cos(2pi), cos(3pi/2), cos(pi)
    inv_freq = torch.tensor([math.pi / 2])
    pos = torch.arange(4)
    keys = _rotate(torch.tensor([[1.0, 0.0]] * 4), pos, inv_freq)[None, None]                 # [1, 1, 4, 2]
    out = triattention_logits(keys, torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[1.0]]]), torch.tensor([4]),
                              inv_freq, max_offset=1)
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0, -1.0])[None, None, None], atol=1e-6, rtol=0)
    # offsets {1, 2}: the mean of the two cosines, e.g. p = 0: (cos(5pi/2) + cos(3pi)) / 2 = -1/2
    out = triattention_logits(keys, torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[1.0]]]), torch.tensor([4]),
                              inv_freq, max_offset=3)
    torch.testing.assert_close(out, torch.tensor([-0.5, 0.5, 0.5, -0.5])[None, None, None], atol=1e-6, rtol=0)


def test_center_phase_and_key_modulus():
    # Center E q = i (pair (0, 1)): arg(E q conj k) = pi/2 for a real key, so p = 3, t = 4, d = 1 gives
    # |k| cos(pi/2 * 2 + pi/2) = 0 and p = 2 gives |k| cos(pi/2 * 3 + pi/2) = |k|; key modulus 2.
    inv_freq = torch.tensor([math.pi / 2])
    keys = _rotate(torch.tensor([[2.0, 0.0], [2.0, 0.0]]), torch.tensor([2, 3]), inv_freq)[None, None]
    out = triattention_logits(keys, torch.tensor([[[0.0, 1.0]]]), torch.tensor([[[1.0]]]), torch.tensor([4]),
                              inv_freq, max_offset=1)
    torch.testing.assert_close(out, torch.tensor([2.0, 0.0])[None, None, None], atol=1e-6, rtol=0)


def test_norm_term_is_excess_modulus_times_key_modulus():
    # E q = 0 (no trig term), E|q_f| = 2: score = 2 * |k| = 2 * 5 for the key (3, 4), whatever its position.
    keys = torch.tensor([[3.0, 4.0], [0.0, 1.0]])[None, None]
    out = triattention_logits(keys, torch.zeros(1, 1, 2), torch.tensor([[[2.0]]]), torch.tensor([7]),
                              torch.tensor([0.3]), max_offset=8)
    torch.testing.assert_close(out, torch.tensor([10.0, 2.0])[None, None, None])


def test_offsets_are_powers_of_two_up_to_max_offset():
    # omega = pi: cos(pi (t - p + d)) = (-1)^(t - p + d); offsets {1, 2, 4} -> mean of (-1)^(x+1), (-1)^x, (-1)^x
    inv_freq = torch.tensor([math.pi])
    keys = _rotate(torch.tensor([[1.0, 0.0]]), torch.tensor([0]), inv_freq)[None, None]
    out = triattention_logits(keys, torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[1.0]]]), torch.tensor([2]),
                              inv_freq, max_offset=7)
    torch.testing.assert_close(out, torch.tensor([1.0 / 3.0])[None, None, None], atol=1e-6, rtol=0)


def test_unrotate_inverts_the_models_rope():
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    pre = torch.randn(2, 3, 5, 8)
    pos = torch.tensor([[0, 3, 9, 10, 400], [1, 2, 5, 7, 8]])
    angle = pos[..., None].float() * inv_freq
    emb = torch.cat([angle, angle], dim=-1)
    post = _apply_rope(pre, emb.cos(), emb.sin())           # the HF engine's own RoPE
    torch.testing.assert_close(unrotate(post, pos[:, None], inv_freq), pre, atol=1e-5, rtol=1e-5)
    s, a, c = center_sums(post, pos, inv_freq, torch.tensor([[True] * 5, [True, True, False, False, False]]))
    torch.testing.assert_close(s[1], pre[1, :, :2].sum(dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[0], torch.hypot(pre[0, ..., :4], pre[0, ..., 4:]).sum(dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c, torch.tensor([5.0, 2.0]))


# ----------------------------------------------------------------------------- authors' algorithm, in loops
def _reference_kept(keys_pre, positions, q_mean, q_abs, t, inv_freq, *, budget, window, max_offset):
    """Kept candidate indices per KV head (a set each), the authors' per-(layer, KV head) pipeline.

    keys_pre: [Hkv, N, D] pre-RoPE keys (the authors un-rotate the cached keys with their positions first;
    the test hands them the result of that exact inversion). q_mean [Hq, D], q_abs [Hq, F] (the calibration's
    q_mean_real/imag and q_abs_mean), positions [Hkv, N], t the round start.
    """
    hkv, n, d = keys_pre.shape
    hq, f_count = q_mean.shape[0], d // 2
    group = hq // hkv
    offsets = []
    v = 1
    while v <= max_offset:
        offsets.append(float(v))
        v *= 2
    per_head = torch.zeros(hq, n, dtype=torch.float64)
    for h in range(hq):
        kv = h // group
        for j in range(n):
            terms = []
            extra = 0.0
            amps, phis = [], []
            for f in range(f_count):
                qc = complex(float(q_mean[h, f]), float(q_mean[h, f + f_count]))
                kc = complex(float(keys_pre[kv, j, f]), float(keys_pre[kv, j, f + f_count]))
                rel = qc * kc.conjugate()
                amps.append(abs(qc) * abs(kc))
                phis.append(math.atan2(rel.imag, rel.real))
                extra += (float(q_abs[h, f]) - abs(qc)) * abs(kc)
            for off in offsets:
                delta = t - float(positions[kv, j]) + off
                terms.append(sum(amps[f] * math.cos(delta * float(inv_freq[f]) + phis[f]) for f in range(f_count)))
            per_head[h, j] = sum(terms) / len(terms) + extra
    mean = per_head.mean(dim=1, keepdim=True)
    std = per_head.std(dim=1, unbiased=False, keepdim=True).clamp_min(1e-6)
    z = (per_head - mean) / std
    kept = []
    for kv in range(hkv):
        agg = z[kv * group:(kv + 1) * group].max(dim=0).values
        past = agg[: n - window]
        order = sorted(range(n - window), key=lambda i: -float(past[i]))
        kept.append(set(order[: budget - window]) | set(range(n - window, n)))
    return kept


@pytest.mark.parametrize("seed,hq,hkv,max_offset", [(0, 4, 2, 65536), (1, 2, 2, 1024), (2, 6, 1, 65536)])
def test_kept_sets_equal_the_authors_algorithm(seed, hq, hkv, max_offset):
    g = torch.Generator().manual_seed(seed)
    d, n, budget, window = 8, 24, 10, 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    # positions as after earlier compressions: increasing, gapped, different per KV head; t past the newest
    positions = torch.stack([torch.randperm(300, generator=g)[:n].sort().values for _ in range(hkv)])
    t = int(positions.max()) + 1
    # keys concentrated around a center with spread (as the paper observes), queries' centers non-trivial
    keys_pre = torch.randn(hkv, 1, d, generator=g, dtype=torch.float64) * 2 + torch.randn(hkv, n, d, generator=g,
                                                                                         dtype=torch.float64)
    q_mean = torch.randn(hq, d, generator=g, dtype=torch.float64)
    q_abs = torch.hypot(q_mean[:, : d // 2], q_mean[:, d // 2:]) + torch.rand(hq, d // 2, generator=g,
                                                                               dtype=torch.float64)
    keys_post = _rotate(keys_pre, positions, inv_freq).float()
    config = CompressionConfig(method="triattention", budget=budget, window=window, buffer=4,
                               triattention_max_offset=max_offset)
    inputs = ScoreInputs(keys=keys_post[None], values=keys_post[None], query_center=q_mean.float()[None],
                         query_abs_center=q_abs.float()[None], query_position=torch.tensor([t]),
                         rope_inv_freq=inv_freq.float())
    kept = choose_kept(config, inputs)[0]
    reference = _reference_kept(keys_pre, positions, q_mean, q_abs, t, inv_freq, budget=budget, window=window,
                                max_offset=max_offset)
    assert [set(k.tolist()) for k in kept] == reference


def test_scorer_needs_the_centers():
    keys = torch.zeros(1, 1, 4, 2)
    cfg = CompressionConfig(method="triattention", budget=3, window=1, buffer=1)
    with pytest.raises(ValueError, match="needs ScoreInputs.query_center, query_abs_center, query_position"):
        get_scorer("triattention")(ScoreInputs(keys=keys, values=keys), cfg)
    with pytest.raises(ValueError, match="triattention_centers must be one of online, file"):
        CompressionConfig(method="triattention", triattention_centers="calibrated")
    with pytest.raises(ValueError, match="needs triattention_centers_path"):
        CompressionConfig(method="triattention", triattention_centers="file")
