"""Single-process worker (TP = PP = DP = 1): CPU compat, parity, log-probs, export, train step, NaN guard,
resume from a checkpoint with optimizer state, and refusal of mismatched checkpoints.

usage: w_single.py RESULT_DIR REF_PT WORK_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)


def check_cpu_compat() -> None:
    import megatron.core.tensor_parallel.random as mrandom
    from torch.overrides import _get_current_function_mode_stack

    from sparse_rl_megatron.learner import cpu_compat

    assert not torch.cuda.is_available()
    assert not cpu_compat.is_applied()
    real_is_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # as on a GPU machine: nothing is patched
    try:
        assert cpu_compat.apply() is False and not cpu_compat.is_applied()
        assert cpu_compat.applied_patches() == [] and torch.zeros(1).type() == "torch.FloatTensor"
    finally:
        torch.cuda.is_available = real_is_available
    assert cpu_compat.apply() is True
    modes = len(_get_current_function_mode_stack())
    assert cpu_compat.apply() is True  # idempotent: nothing is patched or entered twice
    assert len(_get_current_function_mode_stack()) == modes
    # megatron-core was imported above, before apply(): W10 did not take effect; W5 and W7 are armed, not applied
    assert cpu_compat.applied_patches() == ["W1", "W2", "W3", "W4", "W6", "W8", "W9", "W11", "W12", "W13"]
    assert cpu_compat.armed_patches() == ["W5", "W7"]
    # W1
    assert torch.cuda.current_device() == "cpu"
    # W5 is scoped: inside device_mode() (re-entrant, one mode pushed) device="cuda" keyword arguments land on
    # the CPU and t.cuda() is t; outside, torch behaves as usual (no per-op cost for the rest of the process)
    with cpu_compat.device_mode():
        with cpu_compat.device_mode():
            assert len(_get_current_function_mode_stack()) == modes + 1
            t = torch.zeros(3, device="cuda")
            assert t.cuda() is t
            assert t.device.type == "cpu" and torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert len(_get_current_function_mode_stack()) == modes + 1
    assert len(_get_current_function_mode_stack()) == modes
    try:
        torch.zeros(1, device="cuda")
        raise AssertionError("device='cuda' was rewritten outside device_mode()")
    except (RuntimeError, AssertionError) as err:
        assert "rewritten" not in str(err), err
    # W3: the default causal mask, on CPU, True above the diagonal
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    m = tutils.get_default_causal_mask(4)
    assert fused_softmax.get_default_causal_mask is tutils.get_default_causal_mask
    assert m.device.type == "cpu" and m.dtype == torch.bool
    assert torch.equal(m, torch.triu(torch.ones(4, 4, dtype=torch.bool), 1))
    # W2: the RNG tracker keeps CPU generator states; fork() draws from them and restores the outer stream
    from megatron.core import parallel_state as ps

    from sparse_rl_megatron.learner.parallel import init_model_parallel

    init_model_parallel(1, 1, seed=7)
    assert ps.model_parallel_is_initialized()
    tracker = mrandom.get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CPURNGStatesTracker"
    torch.manual_seed(123)
    outer_expected = torch.rand(3)
    torch.manual_seed(123)
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.rand(3), outer_expected), "fork() did not restore the outer CPU RNG stream"
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b), "the forked stream did not advance"
    init_model_parallel(1, 1, seed=7)  # same seed: the tracker restarts at the same state
    with mrandom.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), a)
    # W4, W8
    torch.cuda.synchronize()
    s = torch.cuda.current_stream()
    s.wait_event(None), s.wait_stream(None), s.synchronize()
    # W6: clipping scales grads by max_norm / (total + 1e-6) when that is < 1, never otherwise
    from megatron.core.optimizer import clip_grads, optimizer as moptimizer

    assert moptimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=5.0)
    torch.testing.assert_close(p.grad, torch.tensor([3.0, 4.0]) / (5.0 + 1e-6))
    p.grad = torch.tensor([0.3, 0.4])
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=0.5)
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4]))
    # W9: recompute saves "the CUDA RNG state" and restores it before re-running the forward: the CPU stream
    saved = mrandom._get_cuda_rng_state()
    first = torch.rand(4)
    mrandom._set_cuda_rng_state(saved)
    assert torch.equal(torch.rand(4), first)
    # W7: only inside the scope (within device_mode) do CPU tensors report CUDA type names
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with cpu_compat.device_mode(), cpu_compat.pretend_cuda_tensor_types():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"


class ExtraStateRMSNorm(torch.nn.RMSNorm):
    """An RMSNorm with ``_extra_state`` like Transformer Engine >= 2.0's (an empty uint8 tensor without fp8,
    the pickled recipe state with it: ``payload``), built where megatron builds the final norm from TE."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        self.payload = torch.empty(0, dtype=torch.uint8)

    def get_extra_state(self) -> torch.Tensor:
        return self.payload.clone()

    def set_extra_state(self, state) -> None:
        self.payload = torch.empty(0, dtype=torch.uint8) if state is None else state.clone()


def check_extra_state_checkpoints(refs: dict, work: Path) -> None:
    """Checkpoints travel between a model without extra states (no TE: CPU, ``convert``) and one whose final
    norm carries an extra state (TE installed), both ways; an extra state that holds data is kept."""
    import mcore_checks as C
    from megatron.core.transformer import transformer_block

    ref = refs["llama"]
    plain = C.learner(ref, trainable=False)
    plain.save(work / "no_te_ckpt")
    built_with = transformer_block.LayerNormImpl
    transformer_block.LayerNormImpl = ExtraStateRMSNorm  # what megatron does when TE imports
    try:
        te = C.learner(ref)
        assert "decoder.final_layernorm._extra_state" in te.model.state_dict()
        te.load(work / "no_te_ckpt")  # no TE -> TE (was: Missing key ... final_layernorm._extra_state)
        C.check_logits(te, ref)
        te.train_step(C.train_batch(ref))
        te.save(work / "te_ckpt")
        te.model.decoder.final_layernorm.payload = torch.arange(5, dtype=torch.uint8)  # fp8 recipe state
        te.save(work / "te_ckpt_with_state")
        other = C.learner(ref, trainable=False)
        other.load(work / "te_ckpt_with_state")
        assert torch.equal(other.model.decoder.final_layernorm.payload, torch.arange(5, dtype=torch.uint8))
    finally:
        transformer_block.LayerNormImpl = built_with
    back = C.learner(ref)
    back.load(work / "te_ckpt")  # TE -> no TE, with optimizer state
    assert back.steps == 1
    back.load(work / "te_ckpt_with_state", load_optimizer=False)  # the unknown extra state is left out
    trained = C.exported(te)
    assert all(torch.equal(v, trained[k]) for k, v in C.exported(back).items())


def check_recompute_train_step(refs: dict) -> None:
    """Full activation recompute (the reference run's setting: uniform, one layer per checkpoint) runs on CPU
    and one step equals the HF reference; the model really recomputes (megatron's CheckpointFunction runs)."""
    import mcore_checks as C
    from megatron.core.tensor_parallel import random as mrandom

    ref = refs["qwen2_untied"]
    lrn = C.learner(ref, megatron_overrides=dict(recompute_granularity="full", recompute_method="uniform",
                                                 recompute_num_layers=1))
    assert lrn.describe().endswith("spec=local fusions=none recompute_granularity=full"), lrn.describe()
    calls = []
    real_backward = mrandom.CheckpointFunction.backward

    def counting_backward(ctx, *grads):
        calls.append(1)
        return real_backward(ctx, *grads)

    mrandom.CheckpointFunction.backward = staticmethod(counting_backward)
    try:
        C.check_train_step(lrn, ref)
    finally:
        mrandom.CheckpointFunction.backward = staticmethod(real_backward)
    assert len(calls) == 2 * 3, calls  # 2 layers x 3 micro-batches recomputed in backward


def main() -> None:
    import mcore_checks as C
    from mcore_worker import run_checks

    result_dir, ref_path, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    refs = C.load_refs(ref_path)
    state: dict = {}
    checks = [("cpu_compat", check_cpu_compat)]

    for name, ref in refs.items():
        def build(name=name, ref=ref):
            state[name] = C.learner(ref)

        checks += [
            (f"tp1_build_{name}", build),
            (f"tp1_parity_{name}", lambda name=name, ref=ref: C.check_logits(state[name], ref)),
            (f"tp1_logprobs_{name}", lambda name=name, ref=ref: C.check_logprobs(state[name], ref)),
            (f"tp1_export_{name}", lambda name=name, ref=ref: C.check_export_identical(state[name], ref)),
            (f"tp1_train_{name}", lambda name=name, ref=ref: C.check_train_step(state[name], ref)),
        ]

    def nan_guard():
        C.check_nan_guard(C.learner(refs["qwen2_tied"]), refs["qwen2_tied"])

    def resume():
        ref = refs["llama"]
        a = C.learner(ref)
        a.train_step(C.train_batch(ref))
        a.save(work / "resume_ckpt")
        a.train_step(C.train_batch(ref))
        wa = C.exported(a)
        crashed_save_leaves_checkpoint_intact(a, work / "resume_ckpt")  # b must still load step 1 below
        b = C.learner(ref)
        b.load(work / "resume_ckpt")
        assert b.steps == 1 and b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
        b.train_step(C.train_batch(ref))
        wb = C.exported(b)
        bad = [k for k in wa if not torch.equal(wa[k], wb[k])]
        C.expect(not bad, f"step 2 after resume differs from step 2 without it: {bad[:4]}")  # same process, shapes, data: exact
        state["llama_ckpt"] = work / "resume_ckpt"

    def crashed_save_leaves_checkpoint_intact(lrn, target: Path):
        """A save that dies after megatron wrote its files (before the metadata) must not touch ``target``
        nor leave anything that looks like a finished checkpoint; a non-checkpoint directory is not replaced."""
        import pytest
        from megatron.core import dist_checkpointing

        from sparse_rl_megatron.learner import checkpoint as ckpt

        before = {f.name: f.read_bytes() for f in target.iterdir() if f.is_file()}
        real_save = dist_checkpointing.save

        def save_then_crash(state, path, *args, **kwargs):
            real_save(state, path, *args, **kwargs)
            raise RuntimeError("simulated crash mid-save")

        dist_checkpointing.save = save_then_crash
        try:
            with pytest.raises(RuntimeError, match="simulated crash"):
                lrn.save(target)
        finally:
            dist_checkpointing.save = real_save
        after = {f.name: f.read_bytes() for f in target.iterdir() if f.is_file()}
        assert after == before, "a crashed save changed the existing checkpoint"
        partial = target.with_name(target.name + ".saving")
        assert partial.is_dir() and not (partial / ckpt.META_FILE).exists()
        other = work / "not_a_checkpoint"
        other.mkdir(exist_ok=True)
        (other / "notes.txt").write_text("keep me")
        with pytest.raises(FileExistsError, match="not a sparse-rl Megatron checkpoint; refusing to replace it"):
            lrn.save(other)
        assert (other / "notes.txt").read_text() == "keep me"

    def refuse_other_arch():
        import pytest

        q = state["qwen2_tied"]
        with pytest.raises(ValueError, match=r"another architecture.*family: 'qwen2' vs 'llama'.*hidden_size: 112 vs 64"):
            q.load(state["llama_ckpt"])
        from sparse_rl_megatron.learner.hf_io import load_hf_into_model

        with pytest.raises(ValueError, match=r"another architecture.*num_attention_heads: 14 vs 28"):
            load_hf_into_model(q.model, q.arch, refs["qwen2_untied"]["path"])

    def reference_policy():
        import pytest

        ref = refs["qwen2_untied"]
        frozen = C.learner(ref, trainable=False)  # the KL reference policy: no DDP, no optimizer
        assert frozen.ddp is None and frozen.optimizer is None
        C.check_logprobs(frozen, ref)
        batch = C.sequence_batch()
        base, wide = frozen.logprobs(batch), frozen.logprobs(batch, width=batch.max_response_len + 3)
        assert torch.equal(wide[:, : base.shape[1]], base) and torch.all(wide[:, base.shape[1]:] == 0)
        with pytest.raises(RuntimeError, match="trainable=False"):
            frozen.train_step(C.train_batch(ref))

    def save_hf_after_training():
        from safetensors.torch import load_file

        lrn, ref = state["llama"], refs["llama"]  # trained one step by tp1_train_llama
        out = lrn.save_hf(work / "llama_hf_after_step")
        got, want = load_file(str(out / "model.safetensors")), C.exported(lrn)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in got)
        assert not torch.equal(got["lm_head.weight"], ref["hf"]["lm_head.weight"])  # it is the trained model
        src = Path(ref["path"])
        for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
            assert (out / name).read_bytes() == (src / name).read_bytes(), name

    def empty_slice_advances_lr():
        """A slice the correction emptied takes no optimizer step but moves the lr schedule on: after 2 slices
        (the second all rejected) of a linear decay over 4 steps, the lr is lr / 2, as after two steps."""
        import dataclasses

        from mcore_spec import learner_config, sequences
        from sparse_rl_megatron.learner import Learner
        from sparse_rl_megatron.rollout.sample import Sample
        from sparse_rl_megatron.trainer.optimize import optimizer_steps
        from sparse_rl_megatron.trainer.step import RolloutBatch

        ref = refs["qwen2_tied"]
        cfg = learner_config(ref["path"])
        cfg.optim = dataclasses.replace(cfg.optim, lr_decay_style="linear", lr_decay_steps=4)
        lrn = Learner(cfg)
        prepared = ref["prepared"]
        drop = torch.tensor([False, False, False, True, True, True])
        prepared = dataclasses.replace(prepared, loss_mask=prepared.loss_mask & ~drop[:, None],
                                       keep=prepared.keep & ~drop,
                                       advantages=torch.where(drop, 0.0, prepared.advantages))
        prompts, responses = sequences()
        samples = [Sample(prompt_ids=p.tolist(), response_ids=r.tolist(), sampler_logprobs=torch.zeros(len(r)))
                   for p, r in zip(prompts, responses)]
        metrics = optimizer_steps(lrn, RolloutBatch(samples, C.sequence_batch(), prepared, ref["ref_lp"]), 2)
        assert metrics["train/optimizer_steps"] == 1.0 and metrics["train/empty_slices"] == 1.0, metrics
        assert lrn.steps == 1, lrn.steps
        lr = cfg.optim.lr
        assert abs(lrn.optimizer.param_groups[0]["lr"] - lr / 2) < 1e-12 * lr, lrn.optimizer.param_groups[0]["lr"]
        assert abs(metrics["train/lr"] - lr / 2) < 1e-12 * lr, metrics

    checks.append(("empty_slice_advances_lr", empty_slice_advances_lr))
    checks += [(f"plan_matches_learner_tp1_{name}", lambda ref=ref: C.check_plan_matches_learner(ref, 1, 1))
               for name, ref in refs.items()]
    checks.append(("plan_matches_learner_recompute",
                   lambda: C.check_plan_matches_learner(refs["qwen3"], 1, 1, recompute=True)))
    checks += [("recompute_full_train", lambda: check_recompute_train_step(refs)),
               ("extra_state_checkpoints", lambda: check_extra_state_checkpoints(refs, work)),
               ("nan_guard_tp1", nan_guard), ("resume_with_optimizer_state", resume),
               ("refuse_other_architecture", refuse_other_arch), ("reference_policy_learner", reference_policy),
               ("save_hf_after_training", save_hf_after_training)]
    run_checks(checks, result_dir)


if __name__ == "__main__":
    main()
