"""Load-balancing loss worker (one process): the learner's loss at the checkpoint's scale and without padding.

usage: w_moe_aux.py RESULT_DIR WORK_DIR

The checks are functions of ``test_moe_aux_loss.py`` (launch ``moe_aux``); this file builds their context and
holds the helpers they share.

For each MoE family a tiny model of ``AUX_LAYERS`` layers (so layers / top_k = 2: a coefficient reused per layer
shows) with ``router_aux_loss_coef = HF_COEF``, trained at lr 0 (the weights never move, so every step sees the
same model). What each check compares is in its docstring; the reference is the HF model's own ``aux_loss``
(``output_router_logits=True``, padded rows with their attention mask) times its coefficient.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/megatron: moe_reference, mcore_reference

AUX_LAYERS = 4
HF_COEF = 0.02
FAMILIES = ("qwen3_moe", "qwen2_moe")


def build_model(name: str, root: Path):
    """The HF model of family ``name`` (``mcore_spec.MOE_MODELS`` at ``AUX_LAYERS`` layers), saved under
    ``root/name``; returns ``(model, path)``."""
    import mcore_spec as spec
    from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer

    kw = dict(spec.MOE_MODELS[name])
    family = kw.pop("family")
    from moe_reference import randomise_embedding_row_and_norms

    model = randomise_embedding_row_and_norms(
        build_tiny_model(family, seed=spec.SEED, init_std=spec.INIT_STD, num_layers=AUX_LAYERS, **kw))
    model.config.router_aux_loss_coef = HF_COEF
    path = root / name
    model.save_pretrained(path)
    build_tiny_tokenizer(kw["vocab_size"]).save_pretrained(path)
    return model, path


def hf_reference(model, batch) -> dict:
    """The HF model on ``batch``'s fed tokens, right-padded with their attention mask: ``hf`` = router_aux_loss_coef
    x aux_loss (HF's joint loss over the layers); ``gap`` = coef x (E / T^2) sum_e cov_l(c[., e], S[., e]), what the
    per-layer sum exceeds it by at the derived coefficient (``moe_aux_loss.per_layer_coeff``); ``bound``: the most
    the learner's router logits may differ from HF's; ``margin``: the smallest top-k margin of HF's."""
    from moe_reference import routing_facts

    seqs = [torch.cat([p, r])[:-1] for p, r in zip(batch.prompts, batch.responses)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_router_logits=True)
    cfg = model.config
    e, k, layers = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    real = mask.reshape(-1).bool()
    logits = [z.reshape(-1, e)[real].double() for z in out.router_logits]  # [T, E] per layer, padding dropped
    t = int(real.sum())
    scores = torch.stack([torch.softmax(z, -1).sum(0) for z in logits])  # S [L, E]
    counts = torch.stack([torch.zeros(e, dtype=torch.float64).scatter_add_(
        0, torch.topk(z, k, -1).indices.reshape(-1), torch.ones(t * k, dtype=torch.float64)) for z in logits])
    cov = (counts * scores).mean(0) - counts.mean(0) * scores.mean(0)
    margin, bound = routing_facts(model, seqs, k)
    assert layers == AUX_LAYERS
    return dict(hf=HF_COEF * float(out.aux_loss), gap=HF_COEF * e / t ** 2 * float(cov.sum()), tokens=t,
                experts=e, bound=bound, margin=margin)


def learner_loss(lrn, batch, micro_batches=None) -> float:
    """One step (lr 0) on ``batch``: the learner's whole load-balancing loss, ``coeff x layers x`` the logged
    per-layer one; ``micro_batches``: what ``lrn.micro_batches`` returns instead (a stand-in added)."""
    import mcore_spec as spec
    from sparse_rl_megatron.algo import prepare_correction
    from sparse_rl_megatron.learner import TrainBatch
    from mcore_worker import expect

    mask = batch.response_mask()
    old = torch.zeros(mask.shape)
    sampler, rewards, groups, _ = spec.rollout_tensors(old, mask)
    prepared = prepare_correction(old, sampler, mask, rewards, groups)
    if micro_batches is not None:
        lrn.micro_batches = lambda _batch: micro_batches
    try:
        metrics = lrn.train_step(TrainBatch(batch, prepared))
    finally:
        lrn.__dict__.pop("micro_batches", None)
    expect(metrics["train/skipped"] == 0.0, f"step skipped (non-finite loss or gradient): {metrics}")
    return lrn.moe_aux_loss_coeff * lrn.arch.num_layers * metrics["train/moe_load_balancing_loss"]


def tolerance(ref: dict, value: float) -> float:
    """Learner vs HF, same routing (margin > 2 bound): each score ``exp(z_e) / sum exp(z)`` moves by at most a
    factor ``exp(+-2 bound)`` when every logit moves by ``bound``, so each ``S[l, e]`` and the loss (counts equal,
    scores linear) by ``expm1(2 bound)`` relative; plus the float32 sums (tokens, experts, layers) of the learner."""
    import numerics

    return abs(value) * (math.expm1(2 * ref["bound"])
                         + numerics.chain_bound([ref["tokens"], ref["experts"], AUX_LAYERS], 1.0))


def main() -> None:
    import mcore_spec as spec
    from mcore_worker import run_launch
    from sparse_rl_megatron.learner import SequenceBatch

    result_dir, work = sys.argv[1], Path(sys.argv[2])
    ctx = SimpleNamespace(work=work, batch=SequenceBatch(*spec.sequences()), state={})
    run_launch("moe_aux", ["test_moe_aux_loss"], ctx, result_dir, group_by="model")


if __name__ == "__main__":
    main()
