"""HF <-> Megatron checkpoints: bit-identical round trips, resharding TP1 -> TP2xPP2 -> TP1, resume with
optimizer state, ``sparse-rl convert`` in both directions, and refusal of mismatched checkpoints."""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import mcore_checks as C
from mcore_harness import LAYOUTS, MODELS, at_every_layout, run_cli
from mcore_worker import mcore_check
from test_train_step import check_train


@at_every_layout
def check_export(ctx, layout, model):
    """On the learner of check_build, before check_train trains it."""
    C.check_export_identical(ctx.learners[model], ctx.refs[model])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_weights_bit_identical(request, layout, model):
    """HF -> Megatron (loaded at the layout) -> export_weights buckets: every HF tensor bit-identical, no
    padded vocab rows, no lm_head for tied models."""
    fixture, tag = LAYOUTS[layout]
    request.getfixturevalue(fixture).check(check_export, layout=tag, model=model)


@mcore_check("pair")
def check_bf16_export_tp1pp2(ctx):
    # megatron keeps the torch norms fp32 in a bf16 model: both stages must still plan one bucket
    # layout (was: stage 0 planned bf16 from the embedding, stage 1 fp32 from a norm; gloo aborted)
    ref = ctx.refs["qwen2_tied"]
    lrn = C.learner(ref, 1, 2, trainable=False, params_dtype="bfloat16")
    assert {p.dtype for p in lrn.model.parameters()} == {torch.bfloat16, torch.float32}
    got = C.exported(lrn)
    assert sorted(got) == sorted(ref["hf"])
    bad = [k for k, v in got.items()
           if v.dtype != torch.bfloat16 or not torch.equal(v, ref["hf"][k].to(torch.bfloat16))]
    assert not bad, f"bf16 export differs from the HF weights cast to bf16: {bad[:4]}"


def test_bf16_export_with_pipeline_stages(pair_launch):
    """bf16 model (norm weights kept fp32 by megatron) at PP = 2: every stage exports in one dtype, so the
    stages agree on the buckets; every tensor equals the HF weight cast to bf16."""
    pair_launch.check(check_bf16_export_tp1pp2)


def test_convert_cli_round_trip(mcore_refs, tp1_checkpoint, mcore_root):
    """sparse-rl convert hf-to-megatron, then megatron-to-hf: tensors bit-identical, config.json byte-identical,
    tokenizer files carried along."""
    hf_dir = mcore_refs.parent / "qwen2_tied"
    meta = json.loads((tp1_checkpoint / "sparse_rl_checkpoint.json").read_text())
    assert meta["arch"]["family"] == "qwen2" and meta["arch"]["tie_word_embeddings"] is True
    out = mcore_root / "tp1_back_to_hf"
    proc = run_cli("convert", "megatron-to-hf", "--input", str(tp1_checkpoint), "--output", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want, got = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert (out / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes(), name


def test_convert_cli_refuses_bad_input(mcore_refs, mcore_root):
    """A directory that is not a Megatron checkpoint: exit code 2 and a message naming the missing file."""
    proc = run_cli("convert", "megatron-to-hf", "--input", str(mcore_refs.parent / "llama"), "--output",
                   str(mcore_root / "never"))
    assert proc.returncode == 2
    assert "sparse_rl_checkpoint.json not found" in proc.stderr and "hf-to-megatron" in proc.stderr


@mcore_check("grid")
def check_reshard_tp1_to_tp2pp2(ctx):
    ref = ctx.refs["qwen2_tied"]
    lrn = C.learner(ref, 2, 2, path=ctx.tp1_ckpt)  # a TP=1 torch_dist checkpoint into TP=2 x PP=2
    C.check_logits(lrn, ref)
    C.check_export_identical(lrn, ref)
    lrn.save(ctx.work / "tp2pp2_ckpt")
    alive = C.bucket_lifetimes(lrn)
    out = lrn.save_hf(ctx.work / "tp2pp2_live_hf", bucket_bytes=16 * 1024)  # rank 0 writes, streamed
    assert len(alive) > 4, alive
    if dist.get_rank() != 0:  # the others let go of each bucket before the next one is built
        assert max(alive) == 0, f"tensors of the previous bucket still alive: {alive}"
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        got = load_file(str(out / "model.safetensors"))
        assert sorted(got) == sorted(ref["hf"]) and all(torch.equal(got[k], ref["hf"][k]) for k in got)


@mcore_check("grid")
def check_reshard_tp2pp2_to_tp1(ctx):
    ref = ctx.refs["qwen2_tied"]
    lrn = C.learner(ref, 1, 1, path=str(ctx.work / "tp2pp2_ckpt"))  # ... and back to TP=1 (DP = world)
    C.check_logits(lrn, ref)
    C.check_export_identical(lrn, ref)
    if dist.get_rank() == 0:  # the model-free export of the TP2 x PP2 checkpoint
        from safetensors.torch import load_file

        from sparse_rl_megatron.learner import export_to_hf

        out = export_to_hf(ctx.work / "tp2pp2_ckpt", ctx.work / "tp2pp2_hf")
        got = load_file(str(out / "model.safetensors"))
        assert sorted(got) == sorted(ref["hf"])
        assert all(torch.equal(got[k], ref["hf"][k]) for k in got)
    dist.barrier()


@pytest.mark.parametrize("check", [check_reshard_tp1_to_tp2pp2, check_reshard_tp2pp2_to_tp1],
                         ids=["reshard_tp1_to_tp2pp2", "reshard_tp2pp2_to_tp1"])
def test_reshard(grid_launch, check):
    """A TP = 1 checkpoint (from the convert CLI) loads at TP = 2 x PP = 2 (logits parity, export bit-identical),
    is saved there, and loads back at TP = 1 bit-identically; its model-free HF export is bit-identical too."""
    grid_launch.check(check)


@mcore_check("single", after=(check_train,))
def check_save_hf_after_training(ctx):
    from safetensors.torch import load_file

    lrn, ref = ctx.learners["llama"], ctx.refs["llama"]  # trained one step by check_train
    out = lrn.save_hf(ctx.work / "llama_hf_after_step")
    got, want = load_file(str(out / "model.safetensors")), C.exported(lrn)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in got)
    assert not torch.equal(got["lm_head.weight"], ref["hf"]["lm_head.weight"])  # it is the trained model
    src = Path(ref["path"])
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


def test_save_hf_from_live_model(single_launch):
    """Learner.save_hf after a train step writes the trained weights (== export_weights) with the original
    config.json and tokenizer files byte for byte; at TP2 x PP2 it is checked inside reshard_tp1_to_tp2pp2,
    where ranks other than 0 must also let go of each exported bucket before the next is built (streamed)."""
    single_launch.check(check_save_hf_after_training)


def test_hf_writer_shards_and_streams(tmp_path):
    """HFCheckpointWriter takes tensors one at a time, writes a shard whenever shard_bytes gathered (so the host
    holds at most one shard), names several shards like HF with an index, one shard model.safetensors; the
    SafetensorsReader reads back every tensor exactly, views of a larger buffer included."""
    from sparse_rl_megatron.learner.hf_io import HFCheckpointWriter, SafetensorsReader, save_hf_checkpoint

    flat = torch.arange(40, dtype=torch.float32)
    tensors = {"a": flat[:16].view(4, 4), "b": flat[16:32], "c": flat[32:].clone(), "d": torch.ones(3, 2)}
    writer = HFCheckpointWriter(tmp_path / "sharded", {"model_type": "llama"}, shard_bytes=64)
    for name, t in tensors.items():
        writer.add(name, t)
        assert writer._pending_bytes <= 64
    out = writer.close()
    names = sorted(f.name for f in out.iterdir())
    assert names == ["config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4 * (16 + 16 + 8 + 6)
    assert index["weight_map"] == {"a": "model-00001-of-00003.safetensors", "b": "model-00002-of-00003.safetensors",
                                   "c": "model-00003-of-00003.safetensors", "d": "model-00003-of-00003.safetensors"}
    reader = SafetensorsReader(out)
    assert all(torch.equal(reader.get(k), v) for k, v in tensors.items())
    single = save_hf_checkpoint(tmp_path / "single", iter(tensors.items()), {"model_type": "llama"},
                                dtype=torch.bfloat16)
    got = load_file(str(single / "model.safetensors"))
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], v.bfloat16()) for k, v in tensors.items())


@mcore_check("single")
def check_reference_policy_learner(ctx):
    import pytest

    ref = ctx.refs["qwen2_untied"]
    frozen = C.learner(ref, trainable=False)  # the KL reference policy: no DDP, no optimizer
    assert frozen.ddp is None and frozen.optimizer is None
    C.check_logprobs(frozen, ref)
    batch = C.sequence_batch()
    base, wide = frozen.logprobs(batch), frozen.logprobs(batch, width=batch.max_response_len + 3)
    assert torch.equal(wide[:, : base.shape[1]], base) and torch.all(wide[:, base.shape[1]:] == 0)
    with pytest.raises(RuntimeError, match="trainable=False"):
        frozen.train_step(C.train_batch(ref))


def test_reference_policy_learner(single_launch):
    """Learner(trainable=False), the KL reference policy: log-probs match HF, no optimizer, train_step refused."""
    single_launch.check(check_reference_policy_learner)


@mcore_check("single")
def check_resume_with_optimizer_state(ctx):
    ref = ctx.refs["llama"]
    a = C.learner(ref)
    a.train_step(C.train_batch(ref))
    a.save(ctx.work / "resume_ckpt")
    a.train_step(C.train_batch(ref))
    wa = C.exported(a)
    crashed_save_leaves_checkpoint_intact(a, ctx.work / "resume_ckpt", ctx.work)  # b must still load step 1 below
    b = C.learner(ref)
    b.load(ctx.work / "resume_ckpt")
    assert b.steps == 1 and b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    b.train_step(C.train_batch(ref))
    wb = C.exported(b)
    bad = [k for k in wa if not torch.equal(wa[k], wb[k])]
    C.expect(not bad, f"step 2 after resume differs from step 2 without it: {bad[:4]}")  # same process, shapes, data: exact
    ctx.state["llama_ckpt"] = ctx.work / "resume_ckpt"


def crashed_save_leaves_checkpoint_intact(lrn, target: Path, work: Path):
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


def test_resume_with_optimizer_state(single_launch):
    """step 1, save (model + Adam state + LR schedule + counters), step 2 == load, step 2 (bit-identical).
    In between, a save that crashes after megatron wrote its files leaves the step-1 checkpoint byte-identical
    and no finished-looking directory, and a non-checkpoint directory is refused rather than replaced."""
    single_launch.check(check_resume_with_optimizer_state)


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


@mcore_check("single")
def check_extra_state_checkpoints(ctx) -> None:
    """Checkpoints travel between a model without extra states (no TE: CPU, ``convert``) and one whose final
    norm carries an extra state (TE installed), both ways; an extra state that holds data is kept."""
    from megatron.core.transformer import transformer_block

    refs, work = ctx.refs, ctx.work
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


def test_checkpoints_portable_across_te_and_no_te(single_launch):
    """A checkpoint saved without extra states (no Transformer Engine) loads into a model whose final norm has
    an ``_extra_state`` (as megatron builds it when TE imports) and trains; that model's checkpoint (with
    optimizer state) loads back without TE bit-identically; an extra state that holds data survives."""
    single_launch.check(check_extra_state_checkpoints)


@mcore_check("single", after=(check_resume_with_optimizer_state,))
def check_refuse_other_architecture(ctx):
    import pytest

    q = ctx.learners["qwen2_tied"]
    with pytest.raises(ValueError, match=r"another architecture.*family: 'qwen2' vs 'llama'.*hidden_size: 112 vs 64"):
        q.load(ctx.state["llama_ckpt"])
    from sparse_rl_megatron.learner.hf_io import load_hf_into_model

    with pytest.raises(ValueError, match=r"another architecture.*num_attention_heads: 14 vs 28"):
        load_hf_into_model(q.model, q.arch, ctx.refs["qwen2_untied"]["path"])


def test_refuses_checkpoint_of_another_architecture(single_launch):
    """A Llama torch_dist checkpoint into a Qwen2 learner, and a 28-head HF checkpoint into a 14-head model,
    are refused with messages naming the differing fields (family, hidden_size, num_attention_heads)."""
    single_launch.check(check_refuse_other_architecture)
