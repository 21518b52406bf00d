"""The load-balancing loss at the checkpoint's scale and without padding (``learner/moe_aux_loss.py``).

HF defines ``router_aux_loss_coef`` for one loss over all layers jointly; megatron-core adds one per layer. The
learner's per-layer coefficient is the checkpoint's x top_k / layers (``per_layer_coeff``), and padding (padded
rows' right-padding, a stand-in micro-batch) is left out of the routers' statistics. The math part runs here
(no megatron); the learner part in one process (the checks below, run by ``workers/w_moe_aux.py``) on tiny Qwen3-MoE / Qwen2-MoE models of
4 layers, top-2, against the HF model's own ``aux_loss``."""
import math

import pytest
import torch

from mcore_worker import expect, mcore_check
from sparse_rl_megatron.learner.moe_aux_loss import per_layer_coeff
from w_moe_aux import AUX_LAYERS, FAMILIES, HF_COEF, build_model, hf_reference, learner_loss, tolerance

# The launch's checks of one family run together (group_by="model"): each builds on the one before.
PER_FAMILY = [{"model": m} for m in FAMILIES]


def _hf_joint(counts: torch.Tensor, scores: torch.Tensor, tokens: int) -> float:
    """transformers' ``load_balancing_loss_func``: ``E sum_e (C_e / (L T)) (S_e / (L T))`` over the layers'
    concatenation, from per-layer top-k counts and score sums ``[L, E]``."""
    layers, e = counts.shape
    return float(e * (counts.sum(0) / (layers * tokens) * scores.sum(0) / (layers * tokens)).sum())


def _megatron_per_layer(counts: torch.Tensor, scores: torch.Tensor, tokens: int, top_k: int) -> float:
    """megatron-core's ``switch_load_balancing_loss_func`` summed over the layers (coefficient 1)."""
    e = counts.shape[1]
    return float((e / (top_k * tokens ** 2) * (counts * scores).sum(1)).sum())


def test_per_layer_coeff_of_the_published_checkpoints():
    """Qwen3-30B-A3B (48 layers, top-8): the checkpoint's 0.001 is 0.001 x 8 / 48 per layer, a 6x smaller weight
    than reusing it per layer; 235B-A22B (94 layers, top-8): 11.75x. Exact in binary where it can be."""
    assert per_layer_coeff(0.001, 8, 48) == 0.001 * 8 / 48
    assert 0.001 / per_layer_coeff(0.001, 8, 48) == pytest.approx(6.0, rel=1e-15)
    assert 0.001 / per_layer_coeff(0.001, 8, 94) == pytest.approx(11.75, rel=1e-15)
    assert per_layer_coeff(0.5, 2, 4) == 0.25 and per_layer_coeff(0.0, 8, 48) == 0.0
    with pytest.raises(ValueError, match="num_layers >= 1"):
        per_layer_coeff(0.001, 8, 0)


def test_joint_loss_is_the_per_layer_sum_minus_the_layer_covariance():
    """The identity ``per_layer_coeff``'s docstring states, on random routings (float64): HF's joint loss =
    (k / L) x megatron's per-layer sum - (E / T^2) sum_e cov_l(c, S); equal when every layer routes alike."""
    g = torch.Generator().manual_seed(0)
    layers, tokens, e, k = 5, 37, 8, 3
    logits = torch.randn(layers, tokens, e, generator=g, dtype=torch.float64) * 2
    probs = torch.softmax(logits, -1)
    counts = torch.zeros(layers, e, dtype=torch.float64).scatter_add_(
        1, torch.topk(probs, k, -1).indices.reshape(layers, -1), torch.ones(layers, tokens * k, dtype=torch.float64))
    scores = probs.sum(1)
    cov = ((counts * scores).mean(0) - counts.mean(0) * scores.mean(0)).sum()
    joint, per_layer = _hf_joint(counts, scores, tokens), _megatron_per_layer(counts, scores, tokens, k)
    assert joint == pytest.approx(k / layers * per_layer - e / tokens ** 2 * float(cov), rel=1e-12)
    assert abs(cov) > 1e-3  # the layers route differently here: the two differ
    same = (counts[:1].expand(layers, -1), scores[:1].expand(layers, -1))
    assert _hf_joint(*same, tokens) == pytest.approx(k / layers * _megatron_per_layer(*same, tokens, k), rel=1e-12)
    # perfectly balanced: HF's loss is k, megatron's is 1 per layer
    flat = (torch.full((layers, e), tokens * k / e), torch.full((layers, e), tokens / e))
    assert math.isclose(_hf_joint(*flat, tokens), k) and math.isclose(_megatron_per_layer(*flat, tokens, k), layers)


@pytest.fixture(scope="module")
def aux_launch(tmp_path_factory):
    from mcore_harness import launch

    root = tmp_path_factory.mktemp("moe_aux")
    (root / "work").mkdir()
    return launch("w_moe_aux.py", 1, [str(root / "work")], root / "results")


@mcore_check("moe_aux", params=PER_FAMILY)
def check_build(ctx, model):
    from sparse_rl_megatron.learner import Learner
    from sparse_rl_megatron.learner.config import LearnerConfig, OptimConfig

    hf_model, path = build_model(model, ctx.work)
    ctx.state.clear()
    ctx.state["ref"] = hf_reference(hf_model, ctx.batch)
    assert ctx.state["ref"]["margin"] > 2 * ctx.state["ref"]["bound"], ctx.state["ref"]
    ctx.state["lrn"] = lambda layout: Learner(LearnerConfig(
        model_path=str(path), layer_spec="local", params_dtype="float32", batch_layout=layout,
        max_tokens_per_device=1000, optim=OptimConfig(lr=0.0)))


@mcore_check("moe_aux", params=PER_FAMILY)
def check_coefficient(ctx, model):
    """No explicit value: the per-layer coefficient is the checkpoint's x top_k / layers."""
    lrn = ctx.state["lrn"]("packed")
    ctx.state["packed"] = lrn
    want = per_layer_coeff(HF_COEF, lrn.arch.moe.top_k, AUX_LAYERS)
    expect(want == HF_COEF * 2 / 4, f"per_layer_coeff({HF_COEF}, 2, 4) = {want}")
    expect(lrn.moe_aux_loss_coeff == want, f"coefficient {lrn.moe_aux_loss_coeff!r}, want {want!r}")


@pytest.mark.parametrize("model", FAMILIES)
def test_coefficient_follows_the_checkpoint(aux_launch, model):
    """No ``learner.moe.aux_loss_coeff``: the learner's per-layer coefficient is router_aux_loss_coef x 2 / 4."""
    aux_launch.check(check_build, model=model)
    aux_launch.check(check_coefficient, model=model)


@mcore_check("moe_aux", params=PER_FAMILY)
def check_matches_hf(ctx, model):
    """Every row in one packed micro-batch (no padding): the learner's loss is HF's plus the covariance
    gap of ``hf_reference`` (the loss at the checkpoint's scale; a coefficient reused per layer doubles it)."""
    ref = ctx.state["ref"]
    got = ctx.state["got"] = learner_loss(ctx.state["packed"], ctx.batch)
    want = ref["hf"] + ref["gap"]
    tol = tolerance(ref, want)
    expect(abs(got - want) <= tol, f"learner {got!r} vs HF {ref['hf']!r} + gap {ref['gap']!r} = {want!r} "
                                   f"(tolerance {tol:.3g})")


@pytest.mark.parametrize("model", FAMILIES)
def test_learner_loss_reproduces_hf_aux_loss(aux_launch, model):
    """One packed micro-batch: the learner's whole load-balancing loss = HF's coef x aux_loss + the layers'
    covariance term, within the router's error bound (reusing the coefficient per layer gives twice that)."""
    aux_launch.check(check_matches_hf, model=model)


@mcore_check("moe_aux", params=PER_FAMILY)
def check_stand_in_counts_nothing(ctx, model):
    """The same micro-batch plus a stand-in (a rank's padding micro-batch): the loss does not move, and
    the step stays finite (the stand-in's loss is 0, not 0/0)."""
    from sparse_rl_megatron.learner.batch import padding_micro_batch

    lrn = ctx.state["packed"]
    mbs = lrn.micro_batches(ctx.batch)  # the one micro-batch (rows longest first) of ``matches_hf``
    assert len(mbs) == 1
    mbs.append(padding_micro_batch(ctx.batch, "packed"))
    got = learner_loss(lrn, ctx.batch, mbs)
    expect(got == ctx.state["got"], f"with a stand-in {got!r}, without {ctx.state['got']!r}")


@pytest.mark.parametrize("model", FAMILIES)
def test_stand_in_micro_batch_counts_no_token(aux_launch, model):
    """A stand-in micro-batch beside the real one leaves the loss bit for bit unchanged and the step finite."""
    aux_launch.check(check_stand_in_counts_nothing, model=model)


@mcore_check("moe_aux", params=PER_FAMILY)
def check_padded_equals_packed(ctx, model):
    """The same rows right-padded to the longest in one micro-batch: the loss equals the packed one's
    (padding left out of the routers' statistics), both within the tolerance of HF's."""
    ref = ctx.state["ref"]
    got = learner_loss(ctx.state["lrn"]("padded"), ctx.batch)
    tol = tolerance(ref, ref["hf"] + ref["gap"])
    expect(abs(got - ctx.state["got"]) <= 2 * tol, f"padded {got!r} vs packed {ctx.state['got']!r} "
                                                   f"(tolerance {2 * tol:.3g})")


@pytest.mark.parametrize("model", FAMILIES)
def test_padding_is_left_out_of_the_loss(aux_launch, model):
    """The same rows right-padded in one micro-batch: the same loss as packed (no padding)."""
    aux_launch.check(check_padded_equals_packed, model=model)
