"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its gated shared expert) in the learner == HF transformers for the
same weights, at EP 1 and 2 (DP 2), TP 2 x EP 2 (expert TP 2) and PP 2 x EP 2: logits and log-probs within the error
model's bound (``mcore_spec``, with the MoE reductions of ``numerics.moe_transformer_reductions``), export
bit-identical, one optimizer step equal to HF + AdamW (``STEP_ATOL``), the load-balancing loss's normalisation, the
CPU compatibility patches W11-W13, and a checkpoint resharded TP1 -> PP2 x EP2 -> EP4.

Models (``workers/mcore_spec.MOE_MODELS``): 4 routed experts of width 32, top-2, 2 layers, vocab 250 padded to 256,
norm weights randomised; every comparison is meaningful only because no routed token's top-k choice sits within
twice the router-logit bound of a tie (``routing_margin``)."""
import pytest

from moe_reference import MOE_GRID_LAYOUTS, MOE_PAIR_LAYOUTS

MOE_MODELS = ("qwen3_moe", "qwen2_moe")


def _layouts():
    out = []
    for fixture, spec in (("moe_pair_launch", MOE_PAIR_LAYOUTS), ("moe_grid_launch", MOE_GRID_LAYOUTS)):
        for layout in spec.split(","):
            shape, _, only = layout.partition(":")
            tp, pp, ep, *rest = (int(x) for x in shape.split("x"))
            etp = rest[0] if rest else 1
            tag = f"tp{tp}pp{pp}ep{ep}" + (f"etp{etp}" if etp != 1 else "")
            for model in (only.split("+") if only else MOE_MODELS):
                out.append(pytest.param(fixture, tag, model, tp, id=f"{fixture.removesuffix('_launch')}-{tag}-{model}"))
    return out


LAYOUTS = _layouts()


@pytest.mark.parametrize("model", MOE_MODELS)
def test_routing_margins_make_the_comparisons_meaningful(moe_pair_launch, model):
    moe_pair_launch.check(f"routing_margin_{model}")


@pytest.mark.parametrize("fixture,tag,model,tp", LAYOUTS)
def test_logits_match_hf(request, fixture, tag, model, tp):
    """Learner logits (TP-gathered, padded vocab dropped) vs HF within ``logits_atol``; at TP 2 training is refused
    first, naming megatron_overrides.sequence_parallel."""
    result = request.getfixturevalue(fixture)
    result.check(f"{tag}_build_{model}")
    result.check(f"{tag}_parity_{model}")


@pytest.mark.parametrize("fixture,tag,model,tp", LAYOUTS)
def test_logprobs_match_hf_log_softmax(request, fixture, tag, model, tp):
    """Padded and packed layouts, chunked and unchunked head: log-probs vs log_softmax(HF), identical on every rank."""
    request.getfixturevalue(fixture).check(f"{tag}_logprobs_{model}")


@pytest.mark.parametrize("fixture,tag,model,tp", LAYOUTS)
def test_export_bit_identical(request, fixture, tag, model, tp):
    """Every expert (gathered over expert TP, broadcast from the EP rank that holds it) and every other tensor of
    the HF checkpoint, bit for bit."""
    request.getfixturevalue(fixture).check(f"{tag}_export_{model}")


@pytest.mark.parametrize("fixture,tag,model,tp", [p for p in LAYOUTS if p.values[3] == 1])
def test_one_step_matches_reference(request, fixture, tag, model, tp):
    """One optimizer step (load-balancing loss off) equals HF + AdamW on the whole batch."""
    request.getfixturevalue(fixture).check(f"{tag}_train_{model}")


@pytest.mark.parametrize("model", MOE_MODELS)
def test_load_balancing_loss_is_the_token_weighted_mean(moe_pair_launch, model):
    """With the load-balancing loss on (DP 2, EP 2, one packed micro-batch per rank): the step equals HF's with each
    rank's Switch loss weighted by its share of the step's tokens, and the logged loss equals it per layer."""
    moe_pair_launch.check(f"aux_step_{model}")


@pytest.mark.parametrize("model", MOE_MODELS)
def test_ranks_with_fewer_micro_batches_pad_to_the_most(moe_pair_launch, model):
    """EP 2 x DP 2 with a token budget that cuts the ranks' rows into 2 and 3 micro-batches: the rank with fewer runs
    padding micro-batches, so the expert all-to-alls pair up; log-probs and one step equal HF's."""
    moe_pair_launch.check(f"uneven_micro_batches_{model}")


@pytest.mark.parametrize("model", MOE_MODELS)
@pytest.mark.parametrize("check", ["ep1", "ep2_distopt"])
def test_plan_matches_the_learner(moe_pair_launch, model, check):
    """``sparse-rl plan``'s MoE figures against the learner: parameters, fp32 gradients and Adam state per GPU exactly,
    at EP 1 the bytes each micro-batch keeps for backward within 0.5% (+ 512 B); at EP 2 with the distributed
    optimizer, each rank's routed experts (half of them) and their Adam state."""
    moe_pair_launch.check(f"plan_matches_learner_{check}_{model}")


def test_cpu_compat_moe_patches(moe_pair_launch):
    """W11 (te_general_gemm bound to None), W12 (the alltoall dispatcher's stream, events and numpy split sizes on
    CPU), W13 (the router's expert-bias function eager: no inductor import)."""
    moe_pair_launch.check("cpu_compat_moe")


def test_reshard_tp1_to_pp2ep2_to_ep4(moe_grid_launch):
    """The convert CLI's TP = EP = 1 checkpoint loads at PP 2 x EP 2 (logits, export), is saved there, loads at EP 4
    bit-identically, and its model-free HF export is bit-identical."""
    moe_grid_launch.check("reshard_tp1_to_pp2ep2_to_ep4")
