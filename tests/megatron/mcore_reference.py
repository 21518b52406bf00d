"""HF-side references for the megatron tests, computed in the pytest process with transformers.

For every model of ``mcore_spec.MODELS``: the HF checkpoint directory, logits on ``parity_ids()``, the
log-probs of ``sequences()``, a prepared training batch, and the weights after ONE optimizer step computed
with plain HF + ``torch.optim.AdamW`` with Megatron's semantics (no weight decay on biases and norm weights,
global grad-norm clipping at ``clip_grad``), on the whole batch at once; and the same step on a batch of the one
row ``spec.ONE_ROW`` alone (fewer rows than data-parallel ranks).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file

import mcore_spec as spec


def hf_logprobs(model, prompts, responses) -> torch.Tensor:
    """[B, T] log p(response token) under ``model`` (0 at padding); differentiable."""
    width = max(len(r) for r in responses)
    rows = []
    for p, r in zip(prompts, responses):
        ids = torch.cat([p, r]).unsqueeze(0)
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]
        pos = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        lp = logp[pos, r]
        rows.append(torch.cat([lp, lp.new_zeros(width - len(r))]))
    return torch.stack(rows)


def _one_step(model, prepared, ref_lp, prompts, responses) -> tuple[float, float]:
    """One AdamW step in place; returns the loss and the gradient norm before clipping."""
    from sparse_rl_megatron.algo import LossConfig, micro_batch_loss

    named = [(n, p) for n, p in model.named_parameters()]
    decay = [p for n, p in named if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in named if not (p.ndim > 1 and not n.endswith(".bias"))]
    t = spec.TRAIN
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t["lr"], betas=t["betas"], eps=t["eps"])
    model.train()
    lp = hf_logprobs(model, prompts, responses)
    loss, _ = micro_batch_loss(lp, prepared, LossConfig(kl_coef=spec.KL_COEF), ref_log_probs=ref_lp)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t["clip_grad"])
    opt.step()
    model.eval()
    return float(loss), float(norm)


def build_references(root: Path) -> Path:
    """Write the HF checkpoints under ``root/<model>`` and the references to ``root/ref.pt``; returns the latter."""
    from sparse_rl_megatron.algo import prepare_correction
    from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer

    refs = {}
    prompts, responses = spec.sequences()
    width = max(len(r) for r in responses)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor([len(r) for r in responses]).unsqueeze(1)
    for name, kw in spec.MODELS.items():
        kw = dict(kw)
        family = kw.pop("family")
        model = build_tiny_model(family, seed=spec.SEED, init_std=spec.INIT_STD, **kw)
        # The tiny configs set pad_token_id=0, so HF zero-initialises embedding row 0 and freezes its grad
        # (nn.Embedding(padding_idx)). Real Qwen2.5 / Llama-3 configs have no pad_token_id and the learner
        # trains every row; give row 0 ordinary weights and drop padding_idx so both sides mean the same.
        emb = model.get_input_embeddings()
        with torch.no_grad():
            emb.weight[0] = torch.randn(emb.weight.shape[1], generator=torch.Generator().manual_seed(9)) * spec.INIT_STD
        emb.padding_idx = None
        with torch.no_grad():  # norm weights away from HF's all-ones init, so each norm's mapping is visible
            g = torch.Generator().manual_seed(10)
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.copy_(1 + spec.NORM_STD * torch.randn(p.shape, generator=g))
        path = root / name
        model.save_pretrained(path)
        build_tiny_tokenizer(kw["vocab_size"]).save_pretrained(path)
        stored = load_file(str(path / "model.safetensors"))
        with torch.no_grad():
            logits = model(spec.parity_ids()).logits.float()
            old = hf_logprobs(model, prompts, responses)
        sampler, rewards, groups, ref_lp = spec.rollout_tensors(old, mask)
        prepared = prepare_correction(old, sampler, mask, rewards, groups)
        one = spec.one_row_prepared(prepared)
        k = spec.ONE_ROW
        single = copy.deepcopy(model)
        one_loss, one_norm = _one_step(single, one, ref_lp[k:k + 1, :len(responses[k])], prompts[k:k + 1], responses[k:k + 1])
        after_one_row = {k: v.detach().clone() for k, v in single.state_dict().items() if k in stored}
        _one_step(model, prepared, ref_lp, prompts, responses)
        after = {k: v.detach().clone() for k, v in model.state_dict().items() if k in stored}
        refs[name] = dict(path=str(path), logits=logits, old=old, prepared=prepared, ref_lp=ref_lp,
                          hf=stored, after_step=after, after_step_one_row=after_one_row,
                          one_row_loss=one_loss, one_row_grad_norm=one_norm)
    out = root / "ref.pt"
    torch.save(refs, out)
    return out
