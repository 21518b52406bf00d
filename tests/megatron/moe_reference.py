"""HF-side references for the mixture-of-experts megatron tests (``mcore_spec.MOE_MODELS``), computed in the pytest
process with transformers, like ``mcore_reference.py`` for the dense models.

Per model: the HF checkpoint directory, logits on ``parity_ids()``, the log-probs of ``sequences()``, the prepared
training batch, the smallest top-k routing margin over every routed token and the bound on how far two
computations' router logits can differ (``router_bound``: the error model's probabilistic bound,
``numerics.probabilistic_logprob_bound`` without its vocabulary terms, with the router's own term scale and largest
logit): the parity checks are meaningful only where no expert choice sits within rounding of a tie. And the
weights after one HF + AdamW step
- without the load-balancing loss (``after_step``: any layout, any micro-batching);
- with it (``after_step_aux``, coefficient ``MOE_AUX_COEFF``), for the learner's micro-batching of the packed
  layout at DP = 2 with one micro-batch per rank: megatron-core's Switch loss ``E sum_i f_i P_i`` of each
  micro-batch's tokens and layer, weighted by the micro-batch's share of the step's tokens
  (``learner/moe_aux_loss.py``), and that weighted loss per layer (``aux_metric``, the learner's
  ``train/moe_load_balancing_loss``).
transformers keeps the experts of a layer fused in memory (``gate_up_proj [E, 2F, H]``); its ``save_pretrained``
writes them per expert, as the hub checkpoints are, so every weight reference is read back from a saved copy.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file

import mcore_spec as spec
from mcore_reference import hf_logprobs

AUX_DP = 2  # the data-parallel size whose micro-batching ``after_step_aux`` follows


def switch_loss(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """megatron-core's load-balancing loss of one micro-batch and layer, without the coefficient:
    ``E sum_i f_i P_i``, f_i the share of the top-k assignments that go to expert i, P_i its mean softmax score."""
    scores = torch.softmax(router_logits.float(), dim=-1)
    t, e = scores.shape
    chosen = torch.zeros_like(scores).scatter(1, torch.topk(scores, top_k, dim=1).indices, 1.0)
    return e * ((chosen.sum(0) / (t * top_k)) * scores.mean(0)).sum()


def router_inputs(model, sequences) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(router input [T, H], router weight [E, H])`` of every layer and sequence (forward hooks)."""
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, args, out: seen.append((args[0].reshape(-1, args[0].shape[-1]).float(), mod.weight.float())))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            for ids in sequences:
                model(ids.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return seen


def routing_facts(model, sequences, top_k: int) -> tuple[float, float]:
    """``(smallest top-k margin of the router logits, bound on their difference between two computations)`` over
    every token of ``sequences`` and every layer (``numerics.router_margin``; the bound as in the module docstring)."""
    import numerics

    seen = router_inputs(model, sequences)
    logits = torch.cat([h @ w.T for h, w in seen])
    scale = max(((h * h) @ (w * w).T).max().sqrt().item() for h, w in seen)  # max_e |w_e * h|_2
    mixed, coherent = numerics.hf_decoder_sums(model.config, spec.PARITY_SEQ)
    bound = numerics.probabilistic_logprob_bound(mixed, coherent, 0, scale, logits.abs().max().item(), 0.0)
    return numerics.router_margin(logits, top_k), bound


def router_logits(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``[T, E]`` router logits of one sequence ``ids`` (``[T]``)."""
    return [r.reshape(len(ids), -1) for r in model(ids.unsqueeze(0), output_router_logits=True).router_logits]


def fed(prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """The tokens the learner feeds for a row (the last response token predicts nothing)."""
    return torch.cat([prompt, response])[:-1]


def aux_term(model, prompts, responses, top_k: int) -> torch.Tensor:
    """sum over layers and DP ranks of ``(tokens of the rank / tokens) x switch_loss(the rank's packed tokens)``,
    for ``learner.batch.split_rows`` over ``AUX_DP`` ranks with one packed micro-batch each; differentiable."""
    from sparse_rl_megatron.learner.batch import split_rows

    seqs = [fed(p, r) for p, r in zip(prompts, responses)]
    total = sum(len(s) for s in seqs)
    out = torch.zeros(())
    for rows in split_rows([len(s) for s in seqs], AUX_DP):
        per_row = [router_logits(model, seqs[i]) for i in rows]
        n = sum(len(seqs[i]) for i in rows)
        for layer in range(len(per_row[0])):
            out = out + (n / total) * switch_loss(torch.cat([r[layer] for r in per_row]), top_k)
    return out


def randomise_embedding_row_and_norms(model):
    """As mcore_reference: embedding row 0 (the pad id, zero at init: all its router logits would tie) ordinary,
    norm weights away from 1. Returns ``model``."""
    emb = model.get_input_embeddings()
    with torch.no_grad():
        emb.weight[0] = torch.randn(emb.weight.shape[1], generator=torch.Generator().manual_seed(9)) * spec.INIT_STD
        g = torch.Generator().manual_seed(10)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + spec.NORM_STD * torch.randn(p.shape, generator=g))
    emb.padding_idx = None
    return model


def _one_step(model, prepared, ref_lp, prompts, responses, aux_coeff: float, top_k: int) -> None:
    from sparse_rl_megatron.algo import LossConfig, micro_batch_loss

    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in named if not (p.ndim > 1 and not n.endswith(".bias"))]
    t = spec.TRAIN
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t["lr"], betas=t["betas"], eps=t["eps"])
    model.train()
    loss, _ = micro_batch_loss(hf_logprobs(model, prompts, responses), prepared, LossConfig(kl_coef=spec.KL_COEF),
                               ref_log_probs=ref_lp)
    if aux_coeff:
        loss = loss + aux_coeff * aux_term(model, prompts, responses, top_k)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t["clip_grad"])
    opt.step()
    model.eval()


def _saved_weights(model, path: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


def build_moe_references(root: Path) -> Path:
    """Write the HF checkpoints under ``root/<model>`` and the references to ``root/moe_ref.pt``; returns the latter."""
    from sparse_rl_megatron.algo import prepare_correction
    from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer

    refs = {}
    prompts, responses = spec.sequences()
    width = max(len(r) for r in responses)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor([len(r) for r in responses]).unsqueeze(1)
    for name, kw in spec.MOE_MODELS.items():
        kw = dict(kw)
        family = kw.pop("family")
        model = randomise_embedding_row_and_norms(build_tiny_model(family, seed=spec.SEED, init_std=spec.INIT_STD,
                                                                    **kw))
        path = root / name
        stored = _saved_weights(model, path)
        build_tiny_tokenizer(kw["vocab_size"]).save_pretrained(path)
        top_k = kw["experts_per_token"]
        with torch.no_grad():
            logits = model(spec.parity_ids()).logits.float()
            old = hf_logprobs(model, prompts, responses)
            aux_metric = float(aux_term(model, prompts, responses, top_k)) / spec.NUM_LAYERS
        margin, bound = routing_facts(model, [*spec.parity_ids(), *(fed(p, r) for p, r in zip(prompts, responses))],
                                      top_k)
        sampler, rewards, groups, ref_lp = spec.rollout_tensors(old, mask)
        prepared = prepare_correction(old, sampler, mask, rewards, groups)
        with_aux = copy.deepcopy(model)
        _one_step(with_aux, prepared, ref_lp, prompts, responses, spec.MOE_AUX_COEFF, top_k)
        _one_step(model, prepared, ref_lp, prompts, responses, 0.0, top_k)
        refs[name] = dict(path=str(path), logits=logits, old=old, prepared=prepared, ref_lp=ref_lp, hf=stored,
                          after_step=_saved_weights(model, root / f"{name}_after"),
                          after_step_aux=_saved_weights(with_aux, root / f"{name}_after_aux"),
                          aux_metric=aux_metric, router_margin=margin, router_bound=bound)
    out = root / "moe_ref.pt"
    torch.save(refs, out)
    return out


MOE_PAIR_LAYOUTS = "1x1x1,1x1x2"
"""The two-rank MoE launch's layouts (TP x PP x EP): EP 1 and EP 2 (DP 2)."""
MOE_GRID_LAYOUTS = "2x1x2x2:qwen3_moe,1x2x2:qwen2_moe"
"""The four-rank MoE launch's layouts: TP 2 x EP 2 (expert TP 2) of Qwen3-MoE, PP 2 x EP 2 of Qwen2-MoE."""
