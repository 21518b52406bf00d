"""Checks shared by the megatron workers. Each takes the references of ``mcore_reference.py`` and runs at
whatever layout the parallel state currently has; the comparisons run on every rank that holds the data."""
from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist

import mcore_spec as spec


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


def check_logits(lrn, ref: dict) -> None:
    got = full_logits(lrn, spec.parity_ids())
    if got is not None:
        diff = (got - ref["logits"]).abs().max().item()
        assert diff <= spec.LOGIT_ATOL, f"max |logits - HF| = {diff:.3g} > {spec.LOGIT_ATOL}"


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
    for key, lp in results.items():
        assert lp.shape == ref["old"].shape, (key, lp.shape)
        assert torch.all(lp[~mask] == 0), f"{key}: non-zero log-probs at padding"
        diff = (lp - ref["old"]).abs().max().item()
        assert diff <= spec.LOGPROB_ATOL, f"{key}: max |logprobs - log_softmax(HF)| = {diff:.3g}"
    chunk_diff = (results[("padded", 5)] - results[("padded", 0)]).abs().max().item()
    assert chunk_diff <= spec.CHUNK_ATOL, f"chunked vs unchunked: {chunk_diff:.3g} > {spec.CHUNK_ATOL}"


def check_export_identical(lrn, ref: dict) -> None:
    got = exported(lrn)
    assert sorted(got) == sorted(ref["hf"]), sorted(set(got) ^ set(ref["hf"]))
    bad = [k for k in got if not torch.equal(got[k], ref["hf"][k])]
    assert not bad, f"exported tensors differ from the HF checkpoint: {bad[:5]}"


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
    assert metrics["train/skipped"] == 0.0, metrics
    got = exported(lrn)
    worst = max((got[k] - ref["after_step"][k]).abs().max().item() for k in got)
    moved = max((ref["after_step"][k] - ref["hf"][k]).abs().max().item() for k in got)
    assert moved > 10 * spec.STEP_ATOL, f"reference barely moved ({moved:.3g}): the check would be vacuous"
    assert worst <= spec.STEP_ATOL, f"max |weights - HF reference| after one step = {worst:.3g} > {spec.STEP_ATOL}"
    check_tied_copies_in_sync(lrn)
    return metrics


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

    def spec_with_sp_norms(name="auto"):
        spec = real_spec(name)
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
