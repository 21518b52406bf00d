"""HF <-> Megatron checkpoints: bit-identical round trips, resharding TP1 -> TP2xPP2 -> TP1, resume with
optimizer state, ``sparse-rl convert`` in both directions, and refusal of mismatched checkpoints."""
import json

import pytest
import torch
from safetensors.torch import load_file

from mcore_harness import LAYOUTS, MODELS, run_cli


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_weights_bit_identical(request, layout, model):
    """HF -> Megatron (loaded at the layout) -> export_weights buckets: every HF tensor bit-identical, no
    padded vocab rows, no lm_head for tied models."""
    fixture, tag = LAYOUTS[layout]
    request.getfixturevalue(fixture).check(f"{tag}_export_{model}")


def test_bf16_export_with_pipeline_stages(pair_launch):
    """bf16 model (norm weights kept fp32 by megatron) at PP = 2: every stage exports in one dtype, so the
    stages agree on the buckets; every tensor equals the HF weight cast to bf16."""
    pair_launch.check("bf16_export_tp1pp2")


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


@pytest.mark.parametrize("check", ["reshard_tp1_to_tp2pp2", "reshard_tp2pp2_to_tp1"])
def test_reshard(grid_launch, check):
    """A TP = 1 checkpoint (from the convert CLI) loads at TP = 2 x PP = 2 (logits parity, export bit-identical),
    is saved there, and loads back at TP = 1 bit-identically; its model-free HF export is bit-identical too."""
    grid_launch.check(check)


def test_save_hf_from_live_model(single_launch):
    """Learner.save_hf after a train step writes the trained weights (== export_weights) with the original
    config.json and tokenizer files byte for byte; at TP2 x PP2 it is checked inside reshard_tp1_to_tp2pp2,
    where ranks other than 0 must also let go of each exported bucket before the next is built (streamed)."""
    single_launch.check("save_hf_after_training")


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


def test_reference_policy_learner(single_launch):
    """Learner(trainable=False), the KL reference policy: log-probs match HF, no optimizer, train_step refused."""
    single_launch.check("reference_policy_learner")


def test_resume_with_optimizer_state(single_launch):
    """step 1, save (model + Adam state + LR schedule + counters), step 2 == load, step 2 (bit-identical).
    In between, a save that crashes after megatron wrote its files leaves the step-1 checkpoint byte-identical
    and no finished-looking directory, and a non-checkpoint directory is refused rather than replaced."""
    single_launch.check("resume_with_optimizer_state")


def test_checkpoints_portable_across_te_and_no_te(single_launch):
    """A checkpoint saved without extra states (no Transformer Engine) loads into a model whose final norm has
    an ``_extra_state`` (as megatron builds it when TE imports) and trains; that model's checkpoint (with
    optimizer state) loads back without TE bit-identically; an extra state that holds data survives."""
    single_launch.check("extra_state_checkpoints")


def test_refuses_checkpoint_of_another_architecture(single_launch):
    """A Llama torch_dist checkpoint into a Qwen2 learner, and a 28-head HF checkpoint into a 14-head model,
    are refused with messages naming the differing fields (family, hidden_size, num_attention_heads)."""
    single_launch.check("refuse_other_architecture")
