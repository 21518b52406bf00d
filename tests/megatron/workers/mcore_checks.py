"""Checks shared by the megatron workers. Each takes the references of ``mcore_reference.py`` and runs at
whatever layout the parallel state currently has; the comparisons run on every rank that holds the data."""
from __future__ import annotations

import dataclasses
import math
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

import mcore_spec as spec
import numerics
from mcore_worker import expect


def load_refs(path: str) -> dict:
    return torch.load(path, weights_only=False)


def learner(ref: dict, tp: int = 1, pp: int = 1, trainable: bool = True, path: str | None = None, **kw):
    from sparse_rl_megatron.learner import Learner

    return Learner(spec.learner_config(path or ref["path"], tp, pp, **kw), trainable=trainable)


def sequence_batch():
    from sparse_rl_megatron.learner import SequenceBatch

    return SequenceBatch(*spec.sequences())


def full_logits(lrn, ids: torch.Tensor) -> torch.Tensor | None:
    """HF-shaped logits ``[b, s, vocab]`` (padding dropped, TP gathered) on the last stage; None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from sparse_rl_megatron.learner.batch import MicroBatch
    from sparse_rl_megatron.learner.forward import run_schedule

    b, s = ids.shape
    empty = torch.zeros(0, dtype=torch.long)
    mb = MicroBatch(rows=list(range(b)), input_ids=ids, position_ids=torch.arange(s).expand(b, s).contiguous(),
                    seq_lengths=[s] * b, gather_index=empty, labels=empty, out_row=empty, out_col=empty)
    model = lrn.model
    model.eval()  # megatron-core's MoE layer refuses TP without sequence parallel in training mode

    def head(_, hidden):
        logits, _ = model.output_layer(hidden, weight=model.output_weight())
        full = gather_from_tensor_model_parallel_region(logits)  # [s, b, padded vocab]
        return full.transpose(0, 1)[..., : lrn.arch.vocab_size].float()

    with torch.no_grad():
        out = run_schedule(model, [mb], head, forward_only=True)
    return out[0] if ps.is_pipeline_last_stage() else None


def bucket_lifetimes(lrn) -> list[int]:
    """Wrap ``lrn.export_weights`` so that, each time a bucket has been built, the returned list gets how many
    tensors of the bucket before it are still alive (anyone still holding them: the consumer, the exporter)."""
    real, alive = lrn.export_weights, []

    def export(*args, **kwargs):
        previous: list = []
        for bucket in real(*args, **kwargs):
            alive.append(sum(ref() is not None for ref in previous))
            previous = [weakref.ref(t) for _, t in bucket]
            yield bucket
            del bucket

    lrn.export_weights = export
    return alive


def exported(lrn) -> dict[str, torch.Tensor]:
    return {k: v.clone() for bucket in lrn.export_weights(bucket_bytes=64 * 1024) for k, v in bucket}


def model_name(ref: dict) -> str:
    return Path(ref["path"]).name


def logit_scale(ref: dict) -> float:
    return ref["logits"].abs().max().item()


def check_logits(lrn, ref: dict) -> None:
    got = full_logits(lrn, spec.parity_ids())
    if got is not None:
        diff, tol = (got - ref["logits"]).abs().max().item(), spec.logits_atol(model_name(ref), logit_scale(ref))
        expect(diff <= tol, f"max |logits - HF| = {diff:.3g} > {tol:.3g}")


def check_logprobs(lrn, ref: dict) -> None:
    """Padded and packed layouts vs log_softmax(HF); chunked vs unchunked head."""
    batch = sequence_batch()
    mask = batch.response_mask()
    cfg = lrn.config
    results = {}
    for layout, chunk in (("padded", 5), ("packed", 5), ("padded", 0)):
        cfg.batch_layout, cfg.logprob_chunk_tokens = layout, chunk
        results[(layout, chunk)] = lrn.logprobs(batch)
    cfg.batch_layout, cfg.logprob_chunk_tokens = "padded", 5
    tol = spec.logprob_atol(model_name(ref), logit_scale(ref))
    for key, lp in results.items():
        assert lp.shape == ref["old"].shape, (key, lp.shape)
        expect(bool(torch.all(lp[~mask] == 0)), f"{key}: non-zero log-probs at padding")
        diff = (lp - ref["old"]).abs().max().item()
        expect(diff <= tol, f"{key}: max |logprobs - log_softmax(HF)| = {diff:.3g} > {tol:.3g}")
    chunk_diff = (results[("padded", 5)] - results[("padded", 0)]).abs().max().item()
    chunk_tol = spec.chunk_atol(ref["hf"], model_name(ref))
    expect(chunk_diff <= chunk_tol, f"chunked vs unchunked: {chunk_diff:.3g} > {chunk_tol:.3g}")


def check_export_identical(lrn, ref: dict) -> None:
    got = exported(lrn)
    assert sorted(got) == sorted(ref["hf"]), sorted(set(got) ^ set(ref["hf"]))
    bad = [k for k in got if not torch.equal(got[k], ref["hf"][k])]  # a copy: exact
    expect(not bad, f"exported tensors differ from the HF checkpoint: {bad[:5]}")


def train_batch(ref: dict, advantages_nan: bool = False):
    from sparse_rl_megatron.learner import TrainBatch

    prepared = ref["prepared"]
    if advantages_nan:
        adv = prepared.advantages.clone()
        adv[0] = float("nan")
        prepared = dataclasses.replace(prepared, advantages=adv)
    return TrainBatch(sequence_batch(), prepared, ref_log_probs=ref["ref_lp"])


def check_train_step(lrn, ref: dict) -> dict:
    """One optimizer step equals the single-process HF + AdamW reference (``spec.STEP_ATOL``)."""
    metrics = lrn.train_step(train_batch(ref))
    expect(metrics["train/skipped"] == 0.0, f"step skipped: {metrics}")
    got = exported(lrn)
    worst = max((got[k] - ref["after_step"][k]).abs().max().item() for k in got)
    moved = max((ref["after_step"][k] - ref["hf"][k]).abs().max().item() for k in got)
    expect(moved > 10 * spec.STEP_ATOL, f"reference barely moved ({moved:.3g}): the check would be vacuous")
    expect(worst <= spec.STEP_ATOL, f"max |weights - HF reference| after one step = {worst:.3g} > {spec.STEP_ATOL}")
    check_tied_copies_in_sync(lrn)
    return metrics


def check_fewer_rows_than_dp(lrn, ref: dict) -> None:
    """A batch of one row at DP >= 2 (the weight-sync probe, a small evaluation, the last slice of a batch): the
    ranks without rows run a padding micro-batch, so log-probs equal HF's and one optimizer step equals the HF
    step on that row alone, on every rank."""
    from megatron.core import parallel_state as ps

    from sparse_rl_megatron.learner import SequenceBatch, TrainBatch
    from sparse_rl_megatron.learner.batch import split_rows

    assert ps.get_data_parallel_world_size() >= 2, "the check needs data parallelism"
    k = spec.ONE_ROW
    prompts, responses = spec.sequences()
    one = SequenceBatch([prompts[k]], [responses[k]])
    assert [] in split_rows(one.lengths, ps.get_data_parallel_world_size())  # some rank really has no row
    lp = lrn.logprobs(one)
    n = len(responses[k])
    assert lp.shape == (1, n), lp.shape
    diff, tol = (lp[0] - ref["old"][k, :n]).abs().max().item(), spec.logprob_atol(model_name(ref), logit_scale(ref))
    expect(diff <= tol, f"one-row log-probs at DP >= 2: max |diff| to HF = {diff:.3g} > {tol:.3g}")
    same_on_all_ranks(lp)
    prepared = spec.one_row_prepared(ref["prepared"])
    metrics = lrn.train_step(TrainBatch(one, prepared, ref_log_probs=ref["ref_lp"][k:k + 1, :n]))
    assert metrics["train/skipped"] == 0.0 and metrics["train/tokens"] == float(one.lengths[0]), metrics
    # the padding rank adds nothing: loss and gradient norm are the row's own (Adam alone would hide a doubled
    # gradient, the update is nearly scale-free)
    for key, want in (("loss/total", ref["one_row_loss"]), ("train/grad_norm", ref["one_row_grad_norm"])):
        tol = spec.step_rtol(model_name(ref)) * abs(want) + numerics.SAFETY * numerics.U_FP32
        expect(abs(metrics[key] - want) <= tol, f"{key} = {metrics[key]!r}, HF {want!r} (tolerance {tol:.3g})")
    got = exported(lrn)
    want = ref["after_step_one_row"]
    worst = max((got[name] - want[name]).abs().max().item() for name in got)
    moved = max((want[name] - ref["hf"][name]).abs().max().item() for name in got)
    expect(moved > 10 * spec.STEP_ATOL, f"reference barely moved ({moved:.3g}): the check would be vacuous")
    expect(worst <= spec.STEP_ATOL, f"one-row step at DP >= 2: max |weights - HF reference| = {worst:.3g}")
    check_tied_copies_in_sync(lrn)


def check_tied_copies_in_sync(lrn) -> None:
    """With tied embeddings at PP > 1 the last stage's LM head is a copy of the first stage's embedding;
    it must stay bit-identical (megatron-core all-reduces the two grads). The export only shows the first."""
    from megatron.core import parallel_state as ps

    if not (lrn.arch.tie_word_embeddings and ps.get_pipeline_model_parallel_world_size() > 1):
        return
    if ps.is_rank_in_embedding_group():
        w = lrn.model.output_weight().detach().contiguous()
        group = ps.get_embedding_group()
        copies = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, w, group=group)
        assert all(torch.equal(c, copies[0]) for c in copies), "tied embedding copies diverged across stages"


def check_nan_guard(lrn, ref: dict) -> None:
    """A NaN in the loss (through the advantages) skips the step on every rank and leaves the weights alone."""
    before = exported(lrn)
    metrics = lrn.train_step(train_batch(ref, advantages_nan=True))
    assert metrics["train/skipped"] == 1.0 and metrics["train/skipped_total"] == 1.0, metrics
    assert lrn.steps == 0 and lrn.skipped_steps == 1
    after = exported(lrn)
    assert all(torch.equal(before[k], after[k]) for k in before), "weights changed on a skipped step"
    check_train_step(lrn, ref)  # the next, finite step trains as if nothing happened
    assert lrn.steps == 1 and lrn.skipped_steps == 1


def same_on_all_ranks(x: torch.Tensor) -> None:
    t = x.clone()
    dist.broadcast(t, src=0)
    assert torch.equal(t, x), "ranks disagree"


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """A torch RMSNorm that takes part in sequence parallel as Transformer Engine's norms do: its weight is
    marked ``sequence_parallel``, so megatron all-reduces its gradient over the TP ranks. megatron's own torch
    norm asserts instead, which is why the learner refuses sequence parallel without TE."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def check_sequence_parallel(ref: dict) -> None:
    """Sequence parallel at TP = 2 (with full recompute, as the reference run): refused with the torch norms;
    with norms that support it, log-probs (padded and packed, chunked and not, odd lengths padded to TP) match
    HF and one step matches the reference."""
    import pytest
    from megatron.core.transformer import transformer_block

    from sparse_rl_megatron.learner import model_provider

    overrides = dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs Transformer Engine norms.*'local' spec here "
                                         r"builds megatron's torch norm for input_layernorm, pre_mlp_layernorm, "
                                         r"final_layernorm"):
        learner(ref, 2, 1, megatron_overrides=overrides)
    real_spec, real_final = model_provider.layer_spec, transformer_block.LayerNormImpl

    def spec_with_sp_norms(name="auto", **kwargs):
        spec = real_spec(name, **kwargs)
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
        return spec

    model_provider.layer_spec, transformer_block.LayerNormImpl = spec_with_sp_norms, SequenceParallelRMSNorm
    try:
        lrn = learner(ref, 2, 1, megatron_overrides=overrides)
    finally:
        model_provider.layer_spec, transformer_block.LayerNormImpl = real_spec, real_final
    assert lrn.model.config.sequence_parallel and lrn.model.output_layer.sequence_parallel and lrn.seq_multiple == 2
    assert any(len(mb.seq_lengths) > 1 and mb.pad_tokens for mb in _packed(lrn))  # padding to TP is exercised
    check_logprobs(lrn, ref)
    same_on_all_ranks(lrn.logprobs(sequence_batch()))
    check_train_step(lrn, ref)


def _packed(lrn):
    layout = lrn.config.batch_layout
    lrn.config.batch_layout = "packed"
    try:
        return lrn.micro_batches(sequence_batch())
    finally:
        lrn.config.batch_layout = layout


# Not in the plan: the loss's terms for response-aligned padding slots (the plan counts scored tokens) and the
# vocab-padding mask of the LM head; a few hundred bytes per micro-batch here.
SMALL_TERMS = 512


def check_plan_matches_learner(ref: dict, tp: int, pp: int, distributed_optimizer: bool = False,
                               recompute: bool = False, ep: int = 1, activations: bool = True, **learner_kw) -> None:
    """``sparse-rl plan`` vs the real learner on this rank: parameters, fp32 grads and Adam state exactly (the
    distributed optimizer's shards: disjoint, summing to all moments, each ~1 / DP), and at PP = 1 the
    activations each micro-batch keeps for backward (recorded with autograd's saved-tensor hooks) within 0.5%
    + ``SMALL_TERMS`` bytes.
    With full recompute only the first micro-batch's forward is compared (the recomputation in backward saves
    again, interleaved with the next micro-batches). A mixture of experts at EP ``ep`` (expert TP 1): its routed
    experts are sharded over the expert data-parallel ranks by the distributed optimizer; ``activations`` False skips
    the activation comparison (at EP > 1 a rank's experts work on however many tokens the router sends them, which
    the plan takes as balanced)."""
    from megatron.core import parallel_state as ps

    from sparse_rl_megatron.planning.activations import MicroBatchShape
    from sparse_rl_megatron.planning.inputs import LearnerSetting
    from sparse_rl_megatron.planning.learner_memory import stage_activations
    from sparse_rl_megatron.planning.measure import SavedTensorMeter
    from sparse_rl_megatron.planning.params import stage_params

    overrides = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    if ep > 1:
        learner_kw.update(expert_parallel_size=ep, expert_tensor_parallel_size=1)
    lrn = learner(ref, tp, pp, distributed_optimizer=distributed_optimizer, logprob_chunk_tokens=0,
                  max_tokens_per_device=40, megatron_overrides=overrides, **learner_kw)
    setting = LearnerSetting(params_dtype="float32", kernels="local", logprob_chunk_tokens=0, recompute=recompute,
                             max_tokens_per_device=40, distributed_optimizer=distributed_optimizer)
    stage, dp = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_world_size()
    tb = train_batch(ref)
    with SavedTensorMeter(lrn.model.parameters()) as meter:
        assert lrn.train_step(tb)["train/skipped"] == 0.0
    n = stage_params(lrn.arch, tp, pp, ep, 1 if ep > 1 else None)[stage]
    assert sum(p.numel() for p in lrn.model.parameters()) == n
    main_grads = sum(p.main_grad.numel() for p in lrn.model.parameters())
    assert main_grads == n and all(p.main_grad.dtype == torch.float32 for p in lrn.model.parameters())
    moments = sum(v.numel() for opt in lrn.optimizer.chained_optimizers for s in opt.optimizer.state.values()
                  for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    if distributed_optimizer:  # disjoint shards of ~n / DP (bucket padding moves a few elements between ranks)
        total = torch.tensor([moments], dtype=torch.float64)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        if ep == 1:
            assert total.item() == 2 * n and abs(moments - 2 * n / dp) <= 0.01 * n / dp, (moments, total.item(), n, dp)
        else:  # the routed experts' state over the expert DP ranks, the rest over DP (the plan's optimizer row)
            from sparse_rl_megatron.planning.params import stage_expert_params

            experts = stage_expert_params(lrn.arch, pp, ep, 1)
            want = 2 * ((n - experts) / dp + experts / ps.get_expert_data_parallel_world_size())
            assert abs(moments - want) <= 0.01 * want, (moments, want, n, experts)
    else:
        assert moments == 2 * n, (moments, n)  # fp32 params: 4 + 4 + 8 bytes per parameter
    if pp > 1 or not activations:
        return  # 1F1B interleaves micro-batches: the per-micro-batch phases are not separable here
    mbs = lrn.micro_batches(tb.sequences)
    saved = meter.phases[:1] if recompute else meter.phases
    assert recompute or len(saved) == len(mbs), (len(saved), len(mbs))
    for got, mb in zip(saved, mbs):
        shape = MicroBatchShape(rows=mb.input_ids.shape[0], row_len=mb.input_ids.shape[1], scored=len(mb.labels))
        act = stage_activations(lrn.arch, tp, pp, stage, shape, setting)
        want = act.kept_recompute if recompute else act.kept
        assert abs(got - want) <= 0.005 * got + SMALL_TERMS, f"micro-batch {shape}: saved {got} B, planned {want:.0f} B"


def check_offload_bit_identical(ref: dict, tp: int, pp: int, steps: int = 2, **learner_kw) -> None:
    """``learner.offload``: a learner put to sleep and woken before each step trains exactly as one that never sleeps
    (weights and logged metrics bit for bit, on every rank), and while it sleeps its device storages hold what the
    mode leaves there, measured: ``all`` 0 bytes of every part (a reference policy's weights too), ``optimizer`` the
    weights and gradients the planner counts (the optimizer 0); woken, every part has its bytes back. A learner asleep
    refuses log-probs, a step, an export and a save in one line."""
    import pytest

    from megatron.core import parallel_state as ps

    from sparse_rl_megatron.learner.offload import OFFLOAD_PARTS
    from sparse_rl_megatron.planning.params import stage_params

    awake = learner(ref, tp, pp, **learner_kw)
    sleepers = {mode: learner(ref, tp, pp, offload=mode, **learner_kw) for mode in ("optimizer", "all")}
    planned = _planned_parts(awake, learner_kw)
    reference = learner(ref, tp, pp, trainable=False, offload="all", **learner_kw)
    stage = ps.get_pipeline_model_parallel_rank()
    n = stage_params(awake.arch, tp, pp, learner_kw.get("expert_parallel_size", 1),
                     learner_kw.get("expert_tensor_parallel_size"))[stage]
    width = awake.params_dtype.itemsize
    timing = ("train/step_time_s", "train/tokens_per_s")
    for step in range(steps):
        tb = train_batch(ref)
        want = {k: v for k, v in awake.train_step(tb).items() if k not in timing}
        full = awake.resident_bytes()
        expect(full["weights"] >= n * width and full["gradients"] >= n * 4, f"awake learner holds {full}")
        for mode, lrn in sleepers.items():
            before, lp_before = lrn.resident_bytes(), lrn.logprobs(sequence_batch())
            freed = lrn.sleep()
            asleep = lrn.resident_bytes()
            if step > 0:  # Adam's moments exist from the first step on: the ledger's figures, measured
                for measured, is_asleep in ((before, False), (asleep, True)):
                    plan_bytes, slack = planned(mode, is_asleep)
                    bad = {p: (measured[p], plan_bytes[p], slack[p]) for p in OFFLOAD_PARTS
                           if abs(measured[p] - plan_bytes[p]) > slack[p]}
                    expect(not bad, f"offload={mode}, {'asleep' if is_asleep else 'awake'}: measured bytes vs "
                                    f"planned (measured, planned, padding) {bad}")
            if mode == "all":
                expect(asleep == dict.fromkeys(OFFLOAD_PARTS, 0), f"offload=all, asleep: {asleep} on the device")
            else:
                expect(asleep["optimizer"] == 0 and asleep["weights"] == before["weights"]
                       and asleep["gradients"] == before["gradients"], f"offload=optimizer, asleep: {asleep}")
            expect(all(freed[p] == before[p] - asleep[p] for p in OFFLOAD_PARTS), f"freed {freed} of {before}")
            refused = [lambda: lrn.train_step(tb), lambda: lrn.save("/nonexistent")]
            if mode == "all":
                refused += [lambda: lrn.logprobs(sequence_batch()), lambda: next(iter(lrn.export_weights()))]
            for call in refused:
                with pytest.raises(RuntimeError, match=r"sleep \(learner.offload=.*\); call wake\(\) first"):
                    call()
            if mode == "all":  # the recompute and sync turns: the weights awake, gradients and optimizer asleep
                lrn.wake(["weights"])
                partial = lrn.resident_bytes()
                expect(partial == {**dict.fromkeys(OFFLOAD_PARTS, 0), "weights": before["weights"]},
                       f"offload=all, weights woken alone: {partial}")
                expect(torch.equal(lrn.logprobs(sequence_batch()), lp_before),
                       "log-probs with the weights woken alone differ from those before the sleep")
            lrn.wake()
            expect(lrn.resident_bytes() == before, f"offload={mode}: woken {lrn.resident_bytes()} != {before}")
            got = {k: v for k, v in lrn.train_step(tb).items() if k not in timing}
            expect(got == want, f"offload={mode}, step {step + 1}: metrics {got} != {want}")
        ref_bytes = reference.resident_bytes()
        reference.sleep()
        expect(reference.resident_bytes() == dict.fromkeys(OFFLOAD_PARTS, 0), "the reference policy's weights stay")
        reference.wake()
        expect(reference.resident_bytes() == ref_bytes, "the reference policy did not get its weights back")
    weights = exported(awake)
    for mode, lrn in sleepers.items():
        got = exported(lrn)
        bad = [k for k in weights if not torch.equal(weights[k], got[k])]
        expect(not bad, f"offload={mode}: weights after {steps} steps differ from the awake learner's: {bad[:4]}")
    same_on_all_ranks(sleepers["all"].logprobs(sequence_batch()))


def _planned_parts(lrn, learner_kw: dict):
    """``(mode, asleep) -> (planned bytes per part, allowance per part)`` for this rank of ``lrn``'s layout:
    ``planning.residency.learner_resident_bytes``. What the plan does not count, each measured here and bounded:
    the padding megatron's DDP adds with the distributed optimizer (each parameter's start to 64 elements, each
    bucket's end to lcm(DP, 128); none without it) in the weights' and gradients' buffers and, up to all of it on
    one rank, in the optimizer's shards (fp32 master + 2 moments); the norms megatron keeps fp32 in a bf16 model
    (2 more bytes each, their own master weights: 4 fewer in the optimizer); Adam's step counts (a 4-byte tensor
    per parameter, on the device only on the CPU). The test's asleep parts are compared exactly: 0 bytes."""
    from megatron.core import parallel_state as ps

    from sparse_rl_megatron.planning.inputs import Layout, LearnerSetting
    from sparse_rl_megatron.planning.params import stage_params
    from sparse_rl_megatron.planning.residency import learner_resident_bytes

    lay = lrn.layout
    ep, etp = learner_kw.get("expert_parallel_size", 1), learner_kw.get("expert_tensor_parallel_size")
    distopt = learner_kw.get("distributed_optimizer", False)
    stage = ps.get_pipeline_model_parallel_rank()
    n = stage_params(lrn.arch, lay.tp, lay.pp, ep, etp)[stage]
    buffers = [*lrn.ddp.buffers, *lrn.ddp.expert_parallel_buffers]
    pads = [b.numel - sum(p.numel() for p in b.params) for b in buffers]  # elements, per buffer (one per dtype)
    expect(sum(b.numel - pad for b, pad in zip(buffers, pads)) == n, "the DDP buffers do not hold the planned parameters")
    for b, pad in zip(buffers, pads):
        rule = len(b.params) * 63 + len(b.buckets) * (math.lcm(lay.dp, 128) - 1) if distopt else 0
        expect(0 <= pad <= rule, f"DDP's padding {pad} elements is outside megatron's rule (at most {rule})")
    e = lrn.params_dtype.itemsize
    fp32_norms = sum(p.numel() for p in lrn.model.parameters() if p.dtype == torch.float32) if e == 2 else 0
    tensors = sum(1 for _ in lrn.model.parameters())
    weight_pad = sum(pad * b.param_dtype.itemsize for b, pad in zip(buffers, pads)) if distopt else 0
    optimizer_bytes = (4 + 8 if e == 2 else 8) if distopt else 0
    allowance = {"weights": weight_pad + 2 * fp32_norms, "gradients": 4 * sum(pads),
                 "optimizer": optimizer_bytes * sum(pads) + 4 * fp32_norms + 4 * tensors}

    def planned(mode: str, asleep: bool):
        setting = LearnerSetting(params_dtype=str(lrn.params_dtype).removeprefix("torch."), kernels="local",
                                 distributed_optimizer=distopt, offload=mode)
        want = learner_resident_bytes(lrn.arch, Layout(lay.tp, lay.pp, lay.dp, ep=ep, etp=etp), setting,
                                      stage=stage, asleep=asleep)
        return want, {p: allowance[p] if want[p] else 0 for p in want}

    return planned
