"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its gated shared expert) in the learner == HF transformers for the
same weights, at EP 1 and 2 (DP 2), TP 2 x EP 2 (expert TP 2) and PP 2 x EP 2: logits and log-probs within the error
model's bound (``mcore_spec``, with the MoE reductions of ``numerics.moe_transformer_reductions``), export
bit-identical, one optimizer step equal to HF + AdamW (``STEP_ATOL``), the load-balancing loss's normalisation, the
CPU compatibility patches W11-W13, and a checkpoint resharded TP1 -> PP2 x EP2 -> EP4.

Models (``workers/mcore_spec.MOE_MODELS``): 4 routed experts of width 32, top-2, 2 layers, vocab 250 padded to 256,
norm weights randomised; every comparison is meaningful only because no routed token's top-k choice sits within
twice the router-logit bound of a tie (``routing_margin``)."""
import re

import pytest
import torch
import torch.distributed as dist

import mcore_checks as C
import mcore_spec as spec
import numerics
from mcore_worker import expect, mcore_check
from moe_reference import MOE_GRID_LAYOUTS, MOE_PAIR_LAYOUTS

MOE_MODELS = ("qwen3_moe", "qwen2_moe")
PER_MODEL = [{"model": m} for m in MOE_MODELS]
LAUNCH_LAYOUTS = (("moe_pair", MOE_PAIR_LAYOUTS), ("moe_grid", MOE_GRID_LAYOUTS))


def _layouts():
    out = []
    for launch, layouts in LAUNCH_LAYOUTS:
        for layout in layouts.split(","):
            shape, _, only = layout.partition(":")
            tp, pp, ep, *rest = (int(x) for x in shape.split("x"))
            etp = rest[0] if rest else 1
            tag = f"tp{tp}pp{pp}ep{ep}" + (f"etp{etp}" if etp != 1 else "")
            for model in (only.split("+") if only else MOE_MODELS):
                out.append(pytest.param(f"{launch}_launch", tag, model, tp, id=f"{launch}-{tag}-{model}"))
    return out


LAYOUTS = _layouts()


def moe_shape(tag: str) -> tuple[int, int, int, int]:
    """TP, PP, EP and expert TP of a layout tag (``tp2pp1ep2etp2``; expert TP 1 unless named)."""
    tp, pp, ep, etp = re.fullmatch(r"tp(\d+)pp(\d+)ep(\d+)(?:etp(\d+))?", tag).groups()
    return int(tp), int(pp), int(ep), int(etp or 1)


def at_every_moe_layout(fn=None, *, trainable_only: bool = False):
    """Register the check ``fn(ctx, layout, model)`` for each model of each layout in ``LAYOUTS`` (only TP 1 ones
    with ``trainable_only``), in the launch that has the layout."""
    def mark(fn):
        for launch, _ in LAUNCH_LAYOUTS:
            fn = mcore_check(launch, params=[{"layout": p.values[1], "model": p.values[2]} for p in LAYOUTS
                                             if p.values[0] == f"{launch}_launch"
                                             and (p.values[3] == 1 or not trainable_only)])(fn)
        return fn

    return mark(fn) if fn else mark


def moe_learner(ref: dict, tp: int, pp: int, ep: int, etp: int = 1, aux: float = 0.0, **kw):
    from sparse_rl_megatron.learner.config import MoESettings

    return C.learner(ref, tp, pp, expert_parallel_size=ep, expert_tensor_parallel_size=etp,
                     moe=MoESettings(aux_loss_coeff=aux), **kw)


@mcore_check("moe_pair", params=PER_MODEL)
def check_routing_is_decided(ctx, model) -> None:
    """The checks below compare routed models: meaningful only if no token's k-th and (k+1)-th router logits are
    within twice the learner-vs-HF error bound of each other (a tie the two could break differently)."""
    name, ref = model, ctx.refs[model]
    margin, bound = ref["router_margin"], ref["router_bound"]
    assert margin > 2 * bound, f"{name}: routing margin {margin:.3g} <= 2 x {bound:.3g}"


@pytest.mark.parametrize("model", MOE_MODELS)
def test_routing_margins_make_the_comparisons_meaningful(moe_pair_launch, model):
    moe_pair_launch.check(check_routing_is_decided, model=model)


@at_every_moe_layout
def check_build(ctx, layout, model):
    import pytest

    ref, (tp, pp, ep, etp) = ctx.refs[model], moe_shape(layout)
    if getattr(ctx, "layout", None) != layout:  # the previous layout's learners go first
        ctx.learners, ctx.layout = {}, layout
    if tp > 1:
        with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} with the mixture of experts .* "
                                             "trains only with megatron_overrides.sequence_parallel=True"):
            moe_learner(ref, tp, pp, ep, etp)
    ctx.learners[model] = moe_learner(ref, tp, pp, ep, etp, trainable=tp == 1)
    assert (ctx.learners[model].layout.ep, ctx.learners[model].layout.etp) == (ep, etp)
    assert " expert_mlp=SequentialMLP " in ctx.learners[model].describe()  # the CPU's experts (test_moe_kernels)


@at_every_moe_layout
def check_parity(ctx, layout, model):
    C.check_logits(ctx.learners[model], ctx.refs[model])


@pytest.mark.parametrize("fixture,tag,model,tp", LAYOUTS)
def test_logits_match_hf(request, fixture, tag, model, tp):
    """Learner logits (TP-gathered, padded vocab dropped) vs HF within ``logits_atol``; at TP 2 training is refused
    first, naming megatron_overrides.sequence_parallel."""
    result = request.getfixturevalue(fixture)
    result.check(check_build, layout=tag, model=model)
    result.check(check_parity, layout=tag, model=model)


@at_every_moe_layout
def check_logprobs(ctx, layout, model):
    C.check_logprobs(ctx.learners[model], ctx.refs[model])
    C.same_on_all_ranks(ctx.learners[model].logprobs(C.sequence_batch()))


@pytest.mark.parametrize("fixture,tag,model,tp", LAYOUTS)
def test_logprobs_match_hf_log_softmax(request, fixture, tag, model, tp):
    """Padded and packed layouts, chunked and unchunked head: log-probs vs log_softmax(HF), identical on every rank."""
    request.getfixturevalue(fixture).check(check_logprobs, layout=tag, model=model)


@at_every_moe_layout
def check_export(ctx, layout, model):
    C.check_export_identical(ctx.learners[model], ctx.refs[model])


@pytest.mark.parametrize("fixture,tag,model,tp", LAYOUTS)
def test_export_bit_identical(request, fixture, tag, model, tp):
    """Every expert (gathered over expert TP, broadcast from the EP rank that holds it) and every other tensor of
    the HF checkpoint, bit for bit."""
    request.getfixturevalue(fixture).check(check_export, layout=tag, model=model)


@at_every_moe_layout(trainable_only=True)
def check_train(ctx, layout, model):
    C.check_train_step(ctx.learners[model], ctx.refs[model])


@pytest.mark.parametrize("fixture,tag,model,tp", [p for p in LAYOUTS if p.values[3] == 1])
def test_one_step_matches_reference(request, fixture, tag, model, tp):
    """One optimizer step (load-balancing loss off) equals HF + AdamW on the whole batch."""
    request.getfixturevalue(fixture).check(check_train, layout=tag, model=model)


@mcore_check("moe_pair", params=PER_MODEL)
def check_aux_step(ctx, model) -> None:
    """One step with the load-balancing loss (coefficient ``MOE_AUX_COEFF``) at DP = 2, EP = 2, packed rows, one
    micro-batch per rank: equals the HF step whose loss adds each rank's Switch loss weighted by its share of the
    step's tokens; ``train/moe_load_balancing_loss`` equals that weighted loss per layer."""
    import torch.distributed as dist

    import mcore_spec as spec
    import numerics

    name, ref = model, ctx.refs[model]
    assert dist.get_world_size() == 2
    lrn = moe_learner(ref, 1, 1, 2, aux=spec.MOE_AUX_COEFF, batch_layout="packed", max_tokens_per_device=1000)
    assert len(lrn.micro_batches(C.sequence_batch())) == 1
    metrics = lrn.train_step(C.train_batch(ref))
    got, want = metrics["train/moe_load_balancing_loss"], ref["aux_metric"]
    tol = numerics.chain_bound(spec.forward_reductions(name) + [len(C.sequence_batch().lengths) * spec.PARITY_SEQ],
                               want)
    expect(abs(got - want) <= tol, f"load-balancing loss {got!r} vs HF {want!r} (tolerance {tol:.3g})")
    weights = C.exported(lrn)
    worst = max((weights[k] - ref["after_step_aux"][k]).abs().max().item() for k in weights)
    aux_moved = max((ref["after_step_aux"][k] - ref["after_step"][k]).abs().max().item() for k in weights)
    expect(aux_moved > 10 * spec.STEP_ATOL, f"the load-balancing loss barely moves the step ({aux_moved:.3g})")
    expect(worst <= spec.STEP_ATOL, f"max |weights - HF reference with the load-balancing loss| = {worst:.3g}")


@pytest.mark.parametrize("model", MOE_MODELS)
def test_load_balancing_loss_is_the_token_weighted_mean(moe_pair_launch, model):
    """With the load-balancing loss on (DP 2, EP 2, one packed micro-batch per rank): the step equals HF's with each
    rank's Switch loss weighted by its share of the step's tokens, and the logged loss equals it per layer."""
    moe_pair_launch.check(check_aux_step, model=model)


@mcore_check("moe_pair", params=PER_MODEL)
def check_uneven_micro_batches(ctx, model) -> None:
    """At EP 2 x DP 2 with a token budget of 18 the two ranks cut their rows into 2 and 3 micro-batches; every MoE
    layer exchanges tokens between them, so the learner pads the shorter list with padding micro-batches (without
    that the ranks' all-to-alls pair up wrongly or hang). Log-probs and one step still equal HF's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from sparse_rl_megatron.learner.batch import plan_micro_batches, split_rows

    ref = ctx.refs[model]
    lrn = moe_learner(ref, 1, 1, 2, max_tokens_per_device=18)
    batch = C.sequence_batch()
    planned = [len(plan_micro_batches(batch.lengths, rows, 18, "padded"))
               for rows in split_rows(batch.lengths, ps.get_data_parallel_world_size())]
    assert len(set(planned)) > 1, f"the budget no longer gives the ranks different micro-batch counts: {planned}"
    mbs = lrn.micro_batches(batch)
    assert len(mbs) == max(planned) and sum(mb.padding for mb in mbs) == max(planned) - planned[dist.get_rank()]
    C.check_logprobs(lrn, ref)
    C.check_train_step(lrn, ref)


@pytest.mark.parametrize("model", MOE_MODELS)
def test_ranks_with_fewer_micro_batches_pad_to_the_most(moe_pair_launch, model):
    """EP 2 x DP 2 with a token budget that cuts the ranks' rows into 2 and 3 micro-batches: the rank with fewer runs
    padding micro-batches, so the expert all-to-alls pair up; log-probs and one step equal HF's."""
    moe_pair_launch.check(check_uneven_micro_batches, model=model)


@mcore_check("moe_pair", params=PER_MODEL)
def check_plan_matches_learner_ep1(ctx, model):
    from sparse_rl_megatron.learner.config import MoESettings

    C.check_plan_matches_learner(ctx.refs[model], 1, 1, moe=MoESettings(aux_loss_coeff=0.0))


@mcore_check("moe_pair", params=PER_MODEL)
def check_plan_matches_learner_ep2_distopt(ctx, model):
    from sparse_rl_megatron.learner.config import MoESettings

    C.check_plan_matches_learner(ctx.refs[model], 1, 1, distributed_optimizer=True, ep=2, activations=False,
                                 moe=MoESettings(aux_loss_coeff=0.0))


@pytest.mark.parametrize("model", MOE_MODELS)
@pytest.mark.parametrize("check", [check_plan_matches_learner_ep1, check_plan_matches_learner_ep2_distopt],
                         ids=["ep1", "ep2_distopt"])
def test_plan_matches_the_learner(moe_pair_launch, model, check):
    """``sparse-rl plan``'s MoE figures against the learner: parameters, fp32 gradients and Adam state per GPU exactly,
    at EP 1 the bytes each micro-batch keeps for backward within 0.5% (+ 512 B); at EP 2 with the distributed
    optimizer, each rank's routed experts (half of them) and their Adam state."""
    moe_pair_launch.check(check, model=model)


@mcore_check("moe_pair")
def check_cpu_compat_moe(ctx) -> None:
    """W11-W13 are in place after MoE models ran forward and backward, and torch.compile never traced a frame
    (W13: the router's expert-bias function runs eagerly; under W10 alone its first call would compile)."""
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    from sparse_rl_megatron.learner import cpu_compat

    assert cpu_compat.applied_patches()[-3:] == ["W11", "W12", "W13"]
    assert moe_utils.te_general_gemm is None
    assert isinstance(token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream, cpu_compat._NullStream)
    assert not isinstance(router.TopKRouter.__dict__["_apply_expert_bias"], cpu_compat.CompileOnFirstCall)
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert type(splits).__module__ == "numpy" and splits.tolist() == [3, 1]
    from torch._dynamo.utils import counters  # torch.optim imports dynamo anyway

    assert counters["frames"]["total"] == 0, f"torch.compile traced {counters['frames']['total']} frames"


def test_cpu_compat_moe_patches(moe_pair_launch):
    """W11 (te_general_gemm bound to None), W12 (the alltoall dispatcher's stream, events and numpy split sizes on
    CPU), W13 (the router's expert-bias function eager: no inductor import)."""
    moe_pair_launch.check(check_cpu_compat_moe)


@mcore_check("moe_grid")
def check_reshard_tp1_to_pp2ep2_to_ep4(ctx):
    ref = ctx.refs["qwen3_moe"]
    lrn = moe_learner(ref, 1, 2, 2, path=ctx.tp1_ckpt)  # the convert CLI's TP1 checkpoint at PP2 x EP2
    C.check_logits(lrn, ref)
    C.check_export_identical(lrn, ref)
    lrn.save(ctx.work / "pp2ep2_ckpt")
    back = moe_learner(ref, 1, 1, 4, trainable=False, path=str(ctx.work / "pp2ep2_ckpt"))  # ... at EP4
    C.check_export_identical(back, ref)
    if dist.get_rank() == 0:  # the model-free export of the PP2 x EP2 checkpoint
        from safetensors.torch import load_file

        from sparse_rl_megatron.learner import export_to_hf

        got = load_file(str(export_to_hf(ctx.work / "pp2ep2_ckpt", ctx.work / "pp2ep2_hf") / "model.safetensors"))
        assert sorted(got) == sorted(ref["hf"]) and all(torch.equal(got[k], ref["hf"][k]) for k in got)
    dist.barrier()


def test_reshard_tp1_to_pp2ep2_to_ep4(moe_grid_launch):
    """The convert CLI's TP = EP = 1 checkpoint loads at PP 2 x EP 2 (logits, export), is saved there, loads at EP 4
    bit-identically, and its model-free HF export is bit-identical."""
    moe_grid_launch.check(check_reshard_tp1_to_pp2ep2_to_ep4)
