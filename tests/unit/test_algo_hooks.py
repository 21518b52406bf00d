"""The slime-compatible correction hook: pinned signature, called exactly the way slime calls it."""
import argparse
import inspect
import math

import pytest
import torch
from algo_fixtures import ADV, RHO, batch

from sparse_rl_megatron.algo import (
    CorrectionConfig,
    check_hook_signature,
    load_hook,
    micro_batch_loss,
    prepare_correction,
    sparse_rl_correction,
)

D = torch.float64
P = inspect.Parameter
PATH = "sparse_rl_megatron.algo.slime_hook.sparse_rl_correction"


def test_signature_is_pinned():
    params = inspect.signature(sparse_rl_correction).parameters
    assert [(n, p.kind) for n, p in params.items()] == [
        ("args", P.POSITIONAL_OR_KEYWORD),
        ("pg_loss", P.KEYWORD_ONLY),
        ("train_log_probs", P.KEYWORD_ONLY),
        ("rollout_log_probs", P.KEYWORD_ONLY),
        ("loss_masks", P.KEYWORD_ONLY),
        ("kwargs", P.VAR_KEYWORD),
    ]
    assert all(p.default is P.empty for p in params.values())
    check_hook_signature(sparse_rl_correction)
    assert load_hook(PATH) is sparse_rl_correction


def _slime_inputs():
    """Per-sample 1-D lists (lengths 3, 2, 3) and the flattened pg_loss, as slime's policy_loss_function builds them."""
    old, sampler, mask, _, _ = batch()
    lengths = [3, 2, 3]
    train = [old[i, :n].float() for i, n in enumerate(lengths)]
    rollout = [sampler[i, :n].float() for i, n in enumerate(lengths)]
    masks = [torch.ones(n, dtype=torch.int32) for n in lengths]
    pg_loss = torch.arange(1.0, 9.0, requires_grad=True)  # one value per token, samples concatenated
    return pg_loss, train, rollout, masks, lengths


def _sum_of_sample_mean(x, masks, lengths):
    """slime's reducer (calculate_per_token_loss=False): sum over samples of the masked per-sample mean."""
    parts = x.split(lengths)
    return sum((p * m).sum() / torch.clamp_min(m.sum(), 1) for p, m in zip(parts, masks))


def test_called_exactly_like_slime():
    pg_loss, train, rollout, masks, lengths = _slime_inputs()
    args = argparse.Namespace(tis_clip=2.0, tis_clip_low=0.0)  # a slime namespace without sparse_rl_* options
    tis_kwargs = {
        "args": args,
        "pg_loss": pg_loss,
        "train_log_probs": train,
        "rollout_log_probs": rollout,
        "loss_masks": masks,
        "total_lengths": [10 + n for n in lengths],
        "response_lengths": lengths,
    }
    tis_func = load_hook(PATH)
    out, new_masks, metrics = tis_func(**tis_kwargs)
    assert [m.tolist() for m in new_masks] == [[1, 0, 1], [1, 1], [0, 0, 0]]
    assert all(m.dtype == torch.int32 for m in new_masks)
    # local (micro-batch) normalisation: kept weights [1.2, 1.0, 0.6, 1.0] -> factor 4 / 3.8
    f = 4 / 3.8
    w = torch.tensor([1.2, 0, 1.0, 0.6, 1.0, 0, 0, 0]) * f
    torch.testing.assert_close(out, pg_loss.detach() * w)
    for key, value in metrics.items():
        assert value.shape == (8,), key
        assert torch.isfinite(value).all(), key
    assert metrics["sparse/vetoed_seq"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert metrics["sparse/rejected_token"].tolist() == [0, 1, 0, 0, 0, 1, 1, 1]
    torch.testing.assert_close(metrics["sparse/rho"], torch.tensor([r for row, n in zip(RHO, lengths) for r in row[:n]]))
    # slime then rebuilds its reducer with the NEW masks; the vetoed sample adds nothing, gradient included
    loss = _sum_of_sample_mean(out, new_masks, lengths)
    loss.backward()
    assert pg_loss.grad[5:].tolist() == [0.0, 0.0, 0.0] and pg_loss.grad[1].item() == 0.0
    # slime averages metrics with the PRE-rejection masks: the veto shows up as 1/3 of the samples
    assert _sum_of_sample_mean(metrics["sparse/vetoed_seq"], masks, lengths).item() / 3 == pytest.approx(1 / 3)


def test_options_from_args_attributes_and_global_stats():
    pg_loss, train, rollout, masks, lengths = _slime_inputs()
    args = argparse.Namespace(sparse_rl_rejection_upper=2.5, sparse_rl_veto_threshold=0.0, sparse_rl_normalise_weights=False)
    out, new_masks, _ = sparse_rl_correction(
        args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks
    )
    # rho 2.0 is now inside the bounds (weight truncated to 1.5); no veto, but rho 5e-5 < 0.5 is rejected
    assert [m.tolist() for m in new_masks] == [[1, 1, 1], [1, 1], [1, 0, 1]]
    torch.testing.assert_close(out, pg_loss.detach() * torch.tensor([1.2, 1.5, 1.0, 0.6, 1.0, 1.0, 0, 1.0]))
    # a global [sum, count] passed as a keyword replaces the micro-batch normalisation
    out2, _, _ = sparse_rl_correction(
        None, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
        sparse_rl_weight_stats=torch.tensor([6.0, 4.0], dtype=D),
    )
    torch.testing.assert_close(out2, pg_loss.detach() * torch.tensor([1.2, 0, 1.0, 0.6, 1.0, 0, 0, 0]) * (4 / 6))


def test_hook_input_errors():
    pg_loss, train, rollout, masks, lengths = _slime_inputs()
    call = dict(pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    with pytest.raises(ValueError, match="context parallelism"):
        sparse_rl_correction(None, **call, response_lengths=[6, 4, 6])
    with pytest.raises(ValueError, match="per-sample lists differ"):
        sparse_rl_correction(None, **{**call, "loss_masks": masks[:2]})
    with pytest.raises(ValueError, match="sample 1: train_log_probs has 2 tokens, rollout_log_probs 3"):
        sparse_rl_correction(None, **{**call, "rollout_log_probs": [rollout[0], rollout[2], rollout[2]]})
    with pytest.raises(ValueError, match=r"pg_loss must be \[N\] with N = 8"):
        sparse_rl_correction(None, **{**call, "pg_loss": pg_loss[:7]})
    with pytest.raises(ValueError, match="not allowed inside"):
        sparse_rl_correction(argparse.Namespace(sparse_rl_mode="custom", sparse_rl_hook="x.y"), **call)
    bad = [t.clone() for t in rollout]
    bad[2][1] = float("nan")
    with pytest.raises(ValueError, match=r"rollout_log_probs has 1 non-finite .* first at index \(2, 1\)"):
        sparse_rl_correction(None, **{**call, "rollout_log_probs": bad})
    bad = [t.clone() for t in train]
    bad[1][0] = float("inf")
    with pytest.raises(ValueError, match=r"train_log_probs has 1 non-finite .* first at index \(1, 0\)"):
        sparse_rl_correction(None, **{**call, "train_log_probs": bad})
    with pytest.raises(ValueError, match=r"args\.sparse_rl_veto_threshold must be in \[0, 1\)"):
        sparse_rl_correction(argparse.Namespace(sparse_rl_veto_threshold=2.0), **call)
    with pytest.raises(ValueError, match="args.sparse_rl_weight_mode: unknown reweighting mode 'cap'"):
        sparse_rl_correction(argparse.Namespace(sparse_rl_weight_mode="cap"), **call)


def test_load_hook_errors():
    with pytest.raises(ValueError, match="dotted path"):
        load_hook("nodots")
    with pytest.raises(ImportError, match="cannot import module 'no_such_pkg.mod'"):
        load_hook("no_such_pkg.mod.fn")
    with pytest.raises(AttributeError, match="has no function 'nope'.*tis_like"):
        load_hook("algo_hook_examples.nope")
    with pytest.raises(TypeError, match="wrong signature.*missing keyword-only.*expected fn\\(args, \\*, pg_loss"):
        load_hook("algo_hook_examples.wrong_signature")
    with pytest.raises(TypeError, match="not callable"):
        load_hook("algo_hook_examples.NOT_CALLABLE")


def test_custom_mode_with_our_hook_matches_builtin_sparse_rl():
    builtin = prepare_correction(*batch())
    custom = prepare_correction(*batch(), CorrectionConfig(mode="custom", hook=PATH))
    assert torch.equal(custom.loss_mask, builtin.loss_mask)
    torch.testing.assert_close(custom.advantages, builtin.advantages)
    old = batch()[0]
    l1, _ = micro_batch_loss(old.clone(), builtin)
    l2, _ = micro_batch_loss(old.clone(), custom)
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=0)  # the hook hands back float32 weights
    assert custom.metrics["hook/sparse/vetoed_seq"] == pytest.approx(3 / 8)  # token-mean over response tokens
    # the hook's whole-sample drops are reported as vetoed, as the built-in veto's are
    assert custom.metrics["sparse/vetoed_seq_frac"] == builtin.metrics["sparse/vetoed_seq_frac"] == pytest.approx(1 / 3)
    assert ADV > 0


def test_custom_mode_reports_what_the_hook_dropped():
    old, sampler, mask, rewards, groups = batch()
    old, sampler, mask = (torch.cat([t, t]) for t in (old, sampler, mask))  # 6 samples, 3 of them dropped
    p = prepare_correction(old, sampler, mask, torch.cat([rewards, rewards]), torch.cat([groups, groups + 10]),
                           CorrectionConfig(mode="custom", hook="algo_hook_examples.veto_odd_samples"))
    assert p.keep.tolist() == [True, False, True, False, True, False]
    assert p.metrics["sparse/vetoed_seq_frac"] == p.metrics["sparse/rejected_seq_frac"] == 0.5
    assert p.metrics["sparse/num_seqs"] == 6.0


def test_custom_mode_with_a_tis_hook_and_refusal_of_non_multiplicative_hooks():
    cfg = CorrectionConfig(mode="custom", hook="algo_hook_examples.tis_like", hook_args={"tis_clip": 1.5})
    p = prepare_correction(*batch(), cfg)
    # no rejection: every response token trains, weights min(rho, 1.5) (the 5e-5 token keeps its tiny weight)
    assert torch.equal(p.loss_mask, p.response_mask) and p.keep.all()
    expected = torch.tensor([[1.2, 1.5, 1.0], [0.6, 1.0, 0.0], [1.0, 5e-5, 1.0]], dtype=D)
    torch.testing.assert_close(p.weights, expected)
    with pytest.raises(ValueError, match="not per-token multiplicative"):
        prepare_correction(*batch(), CorrectionConfig(mode="custom", hook="algo_hook_examples.additive"))
    # garbage on padding (sample 1 has one padded position) is not read, so it is no reason to refuse
    p = prepare_correction(*batch(), CorrectionConfig(mode="custom", hook="algo_hook_examples.nan_on_padding"))
    expected = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.0], [0.5, 0.5, 0.5]], dtype=D)
    torch.testing.assert_close(p.weights, expected)
    assert torch.equal(p.loss_mask, p.response_mask)
