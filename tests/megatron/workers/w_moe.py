"""Mixture-of-experts worker (torchrun, gloo): the MoE models of ``moe_reference.py`` at several TP x PP x EP layouts.

usage: w_moe.py RESULT_DIR MOE_REF_PT WORK_DIR LAYOUTS [EXTRA ...]
  LAYOUTS: comma-separated TPxPPxEP[xETP][:model|:model+model], e.g. 1x1x2,2x1x2x2:qwen3_moe (the rest of the world
           is data parallel; ETP defaults to 1; every MoE model unless named). A layout with TP > 1 checks that
           training is refused (megatron-core's MoE needs sequence parallel there) and runs the rest untrained.
  EXTRA:   cpu_compat (W11-W13) | aux_step (one step with the load-balancing loss at DP = 2, EP = 2)
           | uneven (DP = 2, EP = 2 with different micro-batch counts per rank)
           | plan (``sparse-rl plan`` vs the learner: EP 1 parameters, state and activations; EP 2 parameters and
           the distributed optimizer's expert shards)
           | reshard:<tp1 checkpoint dir of qwen3_moe> (-> TP1 x PP2 x EP2 -> saved -> EP4)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)


def moe_learner(ref: dict, tp: int, pp: int, ep: int, etp: int = 1, aux: float = 0.0, **kw):
    import mcore_checks as C
    from sparse_rl_megatron.learner.config import MoESettings

    return C.learner(ref, tp, pp, expert_parallel_size=ep, expert_tensor_parallel_size=etp,
                     moe=MoESettings(aux_loss_coeff=aux), **kw)


def check_routing_is_decided(name: str, ref: dict) -> None:
    """The checks below compare routed models: meaningful only if no token's k-th and (k+1)-th router logits are
    within twice the learner-vs-HF error bound of each other (a tie the two could break differently)."""
    margin, bound = ref["router_margin"], ref["router_bound"]
    assert margin > 2 * bound, f"{name}: routing margin {margin:.3g} <= 2 x {bound:.3g}"


def check_cpu_compat_moe() -> None:
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


def check_aux_step(name: str, ref: dict) -> None:
    """One step with the load-balancing loss (coefficient ``MOE_AUX_COEFF``) at DP = 2, EP = 2, packed rows, one
    micro-batch per rank: equals the HF step whose loss adds each rank's Switch loss weighted by its share of the
    step's tokens; ``train/moe_load_balancing_loss`` equals that weighted loss per layer."""
    import torch.distributed as dist

    import mcore_checks as C
    import mcore_spec as spec
    import numerics
    from mcore_worker import expect

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


def check_uneven_micro_batches(name: str, ref: dict) -> None:
    """At EP 2 x DP 2 with a token budget of 18 the two ranks cut their rows into 2 and 3 micro-batches; every MoE
    layer exchanges tokens between them, so the learner pads the shorter list with padding micro-batches (without
    that the ranks' all-to-alls pair up wrongly or hang). Log-probs and one step still equal HF's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import mcore_checks as C
    from sparse_rl_megatron.learner.batch import plan_micro_batches, split_rows

    lrn = moe_learner(ref, 1, 1, 2, max_tokens_per_device=18)
    batch = C.sequence_batch()
    planned = [len(plan_micro_batches(batch.lengths, rows, 18, "padded"))
               for rows in split_rows(batch.lengths, ps.get_data_parallel_world_size())]
    assert len(set(planned)) > 1, f"the budget no longer gives the ranks different micro-batch counts: {planned}"
    mbs = lrn.micro_batches(batch)
    assert len(mbs) == max(planned) and sum(mb.padding for mb in mbs) == max(planned) - planned[dist.get_rank()]
    C.check_logprobs(lrn, ref)
    C.check_train_step(lrn, ref)


def main() -> None:
    import torch.distributed as dist

    import mcore_checks as C
    from sparse_rl_megatron.learner.config import MoESettings
    from mcore_worker import run_checks

    result_dir, ref_path, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    refs = C.load_refs(ref_path)
    extras = sys.argv[5:]
    state: dict = {}
    checks = [(f"routing_margin_{name}", lambda name=name, ref=ref: check_routing_is_decided(name, ref))
              for name, ref in refs.items()]
    for layout in sys.argv[4].split(","):
        shape, _, only = layout.partition(":")
        tp, pp, ep, *rest = (int(x) for x in shape.split("x"))
        etp = rest[0] if rest else 1
        tag = f"tp{tp}pp{pp}ep{ep}" + (f"etp{etp}" if etp != 1 else "")
        for name in (only.split("+") if only else list(refs)):
            ref = refs[name]

            def build(ref=ref, tp=tp, pp=pp, ep=ep, etp=etp):
                import pytest

                state.clear()
                if tp > 1:
                    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} with the mixture of experts .* "
                                                         "trains only with megatron_overrides.sequence_parallel=True"):
                        moe_learner(ref, tp, pp, ep, etp)
                state["lrn"] = moe_learner(ref, tp, pp, ep, etp, trainable=tp == 1)
                assert (state["lrn"].layout.ep, state["lrn"].layout.etp) == (ep, etp)
                assert " expert_mlp=SequentialMLP " in state["lrn"].describe()  # the CPU's experts (test_moe_kernels)

            def logprobs_agree(ref=ref):
                C.check_logprobs(state["lrn"], ref)
                C.same_on_all_ranks(state["lrn"].logprobs(C.sequence_batch()))

            checks += [
                (f"{tag}_build_{name}", build),
                (f"{tag}_parity_{name}", lambda ref=ref: C.check_logits(state["lrn"], ref)),
                (f"{tag}_logprobs_{name}", logprobs_agree),
                (f"{tag}_export_{name}", lambda ref=ref: C.check_export_identical(state["lrn"], ref)),
            ]
            if tp == 1:
                checks.append((f"{tag}_train_{name}", lambda ref=ref: C.check_train_step(state["lrn"], ref)))

    for extra in extras:
        if extra == "cpu_compat":
            checks.append(("cpu_compat_moe", check_cpu_compat_moe))
        elif extra == "uneven":
            checks += [(f"uneven_micro_batches_{name}", lambda name=name, ref=ref: check_uneven_micro_batches(name, ref))
                       for name, ref in refs.items()]
        elif extra == "plan":
            for name, ref in refs.items():
                checks.append((f"plan_matches_learner_ep1_{name}", lambda ref=ref: C.check_plan_matches_learner(
                    ref, 1, 1, moe=MoESettings(aux_loss_coeff=0.0))))
                checks.append((f"plan_matches_learner_ep2_distopt_{name}", lambda ref=ref: C.check_plan_matches_learner(
                    ref, 1, 1, distributed_optimizer=True, ep=2, activations=False, moe=MoESettings(aux_loss_coeff=0.0))))
        elif extra == "offload":  # EP 2 over DP 2, with and without the distributed optimizer (expert shards)
            ref = refs["qwen3_moe"]
            checks.append(("offload_ep2", lambda: C.check_offload_bit_identical(
                ref, 1, 1, expert_parallel_size=2, expert_tensor_parallel_size=1, moe=MoESettings(aux_loss_coeff=0.0))))
            checks.append(("offload_ep2_distopt", lambda: C.check_offload_bit_identical(
                ref, 1, 1, expert_parallel_size=2, expert_tensor_parallel_size=1, distributed_optimizer=True,
                moe=MoESettings(aux_loss_coeff=0.0))))
        elif extra == "aux_step":
            checks += [(f"aux_step_{name}", lambda name=name, ref=ref: check_aux_step(name, ref))
                       for name, ref in refs.items()]
        elif extra.startswith("reshard:"):
            tp1_ckpt = extra.split(":", 1)[1]

            def reshard(tp1_ckpt=tp1_ckpt):
                ref = refs["qwen3_moe"]
                lrn = moe_learner(ref, 1, 2, 2, path=tp1_ckpt)  # the convert CLI's TP1 checkpoint at PP2 x EP2
                C.check_logits(lrn, ref)
                C.check_export_identical(lrn, ref)
                lrn.save(work / "pp2ep2_ckpt")
                back = moe_learner(ref, 1, 1, 4, trainable=False, path=str(work / "pp2ep2_ckpt"))  # ... at EP4
                C.check_export_identical(back, ref)
                if dist.get_rank() == 0:  # the model-free export of the PP2 x EP2 checkpoint
                    from safetensors.torch import load_file

                    from sparse_rl_megatron.learner import export_to_hf

                    got = load_file(str(export_to_hf(work / "pp2ep2_ckpt", work / "pp2ep2_hf") / "model.safetensors"))
                    assert sorted(got) == sorted(ref["hf"]) and all(torch.equal(got[k], ref["hf"][k]) for k in got)
                dist.barrier()

            checks.append(("reshard_tp1_to_pp2ep2_to_ep4", reshard))
        else:
            raise SystemExit(f"unknown extra {extra!r}")
    run_checks(checks, result_dir)


if __name__ == "__main__":
    main()
