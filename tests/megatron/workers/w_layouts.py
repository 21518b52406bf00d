"""Multi-rank worker (torchrun, gloo): the same checks at several TP x PP layouts of one world, plus extras.

usage: w_layouts.py RESULT_DIR REF_PT WORK_DIR LAYOUTS [EXTRA ...]
  LAYOUTS: comma-separated TPxPP, e.g. 2x1,1x2,1x1 (the rest of the world is data parallel)
  EXTRA:   nan_guard_pp2 | reshard:<tp1 checkpoint dir> | distopt | bf16_export_pp2 | sequence_parallel
           | plan (the planner vs the learner, per layout) | fewer_rows:TPxPP (a one-row batch at DP >= 2)
           | offload:TPxPP,... (learner.offload bit-identical per layout, and at DP with the bf16 DistributedOptimizer)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)


def main() -> None:
    import torch.distributed as dist

    import mcore_checks as C
    from mcore_worker import run_checks

    result_dir, ref_path, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    layouts = [tuple(int(x) for x in s.split("x")) for s in sys.argv[4].split(",")]
    extras = sys.argv[5:]
    refs = C.load_refs(ref_path)
    state: dict = {}
    checks = []
    for tp, pp in layouts:
        tag = f"tp{tp}pp{pp}"
        for name, ref in refs.items():
            def build(name=name, ref=ref, tp=tp, pp=pp):
                state.clear()
                state["lrn"] = C.learner(ref, tp, pp)

            def logprobs_agree(ref=ref):
                C.check_logprobs(state["lrn"], ref)
                C.same_on_all_ranks(state["lrn"].logprobs(C.sequence_batch()))

            checks += [
                (f"{tag}_build_{name}", build),
                (f"{tag}_parity_{name}", lambda ref=ref: C.check_logits(state["lrn"], ref)),
                (f"{tag}_logprobs_{name}", logprobs_agree),
                (f"{tag}_export_{name}", lambda ref=ref: C.check_export_identical(state["lrn"], ref)),
                (f"{tag}_train_{name}", lambda ref=ref: C.check_train_step(state["lrn"], ref)),
            ]

    for extra in extras:
        if extra == "nan_guard_pp2":
            checks.append(("nan_guard_tp1pp2", lambda: C.check_nan_guard(C.learner(refs["qwen2_tied"], 1, 2),
                                                                          refs["qwen2_tied"])))
        elif extra == "bf16_export_pp2":
            def bf16_export():
                # megatron keeps the torch norms fp32 in a bf16 model: both stages must still plan one bucket
                # layout (was: stage 0 planned bf16 from the embedding, stage 1 fp32 from a norm; gloo aborted)
                ref = refs["qwen2_tied"]
                lrn = C.learner(ref, 1, 2, trainable=False, params_dtype="bfloat16")
                assert {p.dtype for p in lrn.model.parameters()} == {torch.bfloat16, torch.float32}
                got = C.exported(lrn)
                assert sorted(got) == sorted(ref["hf"])
                bad = [k for k, v in got.items()
                       if v.dtype != torch.bfloat16 or not torch.equal(v, ref["hf"][k].to(torch.bfloat16))]
                assert not bad, f"bf16 export differs from the HF weights cast to bf16: {bad[:4]}"
            checks.append(("bf16_export_tp1pp2", bf16_export))
        elif extra == "sequence_parallel":
            checks.append(("sequence_parallel_tp2", lambda: C.check_sequence_parallel(refs["qwen2_untied"])))
        elif extra == "distopt":
            def distopt():
                # data parallel x TP with Megatron's DistributedOptimizer (CPU: W7 patch at construction)
                world = dist.get_world_size()
                lrn = C.learner(refs["qwen2_untied"], 2 if world >= 4 else 1, 1, distributed_optimizer=True)
                assert lrn.layout.dp >= 2
                assert "DistributedOptimizer" in type(lrn.optimizer.chained_optimizers[0]).__name__
                C.check_train_step(lrn, refs["qwen2_untied"])
            checks.append(("distributed_optimizer_train", distopt))
        elif extra == "plan":
            for tp, pp in layouts:
                checks.append((f"plan_matches_learner_tp{tp}pp{pp}",
                               lambda tp=tp, pp=pp: C.check_plan_matches_learner(refs["qwen3"], tp, pp)))
            checks.append(("plan_matches_learner_distopt", lambda: C.check_plan_matches_learner(
                refs["qwen2_untied"], 1, 1, distributed_optimizer=True)))
        elif extra.startswith("offload:"):
            for layout in extra.split(":", 1)[1].split(","):
                tp, pp = (int(x) for x in layout.split("x"))
                checks.append((f"offload_tp{tp}pp{pp}", lambda tp=tp, pp=pp: C.check_offload_bit_identical(
                    refs["qwen2_untied"], tp, pp)))
            checks.append(("offload_distopt_bf16", lambda: C.check_offload_bit_identical(
                refs["qwen2_untied"], 1, 1, distributed_optimizer=True, params_dtype="bfloat16")))
        elif extra.startswith("fewer_rows:"):
            tp, pp = (int(x) for x in extra.split(":", 1)[1].split("x"))
            for name in ("qwen2_tied", "qwen2_untied"):
                checks.append((f"fewer_rows_than_dp_tp{tp}pp{pp}_{name}", lambda name=name, tp=tp, pp=pp:
                               C.check_fewer_rows_than_dp(C.learner(refs[name], tp, pp), refs[name])))
        elif extra.startswith("reshard:"):
            tp1_ckpt = extra.split(":", 1)[1]

            def reshard_in(tp1_ckpt=tp1_ckpt):
                ref = refs["qwen2_tied"]
                lrn = C.learner(ref, 2, 2, path=tp1_ckpt)  # a TP=1 torch_dist checkpoint into TP=2 x PP=2
                C.check_logits(lrn, ref)
                C.check_export_identical(lrn, ref)
                lrn.save(work / "tp2pp2_ckpt")
                alive = C.bucket_lifetimes(lrn)
                out = lrn.save_hf(work / "tp2pp2_live_hf", bucket_bytes=16 * 1024)  # rank 0 writes, streamed
                assert len(alive) > 4, alive
                if dist.get_rank() != 0:  # the others let go of each bucket before the next one is built
                    assert max(alive) == 0, f"tensors of the previous bucket still alive: {alive}"
                if dist.get_rank() == 0:
                    from safetensors.torch import load_file

                    got = load_file(str(out / "model.safetensors"))
                    assert sorted(got) == sorted(ref["hf"]) and all(torch.equal(got[k], ref["hf"][k]) for k in got)

            def reshard_back():
                ref = refs["qwen2_tied"]
                lrn = C.learner(ref, 1, 1, path=str(work / "tp2pp2_ckpt"))  # ... and back to TP=1 (DP = world)
                C.check_logits(lrn, ref)
                C.check_export_identical(lrn, ref)
                if dist.get_rank() == 0:  # the model-free export of the TP2 x PP2 checkpoint
                    from safetensors.torch import load_file

                    from sparse_rl_megatron.learner import export_to_hf

                    out = export_to_hf(work / "tp2pp2_ckpt", work / "tp2pp2_hf")
                    got = load_file(str(out / "model.safetensors"))
                    assert sorted(got) == sorted(ref["hf"])
                    assert all(torch.equal(got[k], ref["hf"][k]) for k in got)
                dist.barrier()

            checks += [("reshard_tp1_to_tp2pp2", reshard_in), ("reshard_tp2pp2_to_tp1", reshard_back)]
        else:
            raise SystemExit(f"unknown extra {extra!r}")
    run_checks(checks, result_dir)


if __name__ == "__main__":
    main()
