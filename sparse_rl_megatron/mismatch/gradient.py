"""The gradient each estimator follows at a warm start, against the dense on-policy gradient (``sparse-rl gradients``).

Shadow Mask Distillation's objection to Sparse-RL: reweighting the compressed sampler's tokens by rho cannot undo a
compression bias (the sampler never writes what the dense policy would, so no weight on what it did write restores
it). Measured here at step 0 of a run, where the current policy is pi_old and the reference policy (the PPO ratio
is 1 and the KL term's gradient 0), so each loss's gradient is its policy gradient:

- **reference** g_ref: plain GRPO on a large dense batch (``reference_samples`` per prompt, a sampler seed of its
  own): the on-policy gradient, up to its own sampling noise;
- per **repeat** (its own sampler seed), the same prompts at ``samples`` per prompt: the **dense** row, plain GRPO on
  a dense batch (its cosine to g_ref is what sampling noise alone leaves at this batch size), and per budget the
  compressed batch under each correction mode (``none``: naive; ``sparse_rl``: rejection + reweighting), pi_old the
  dense model's log-probs of the sampled tokens, as the trainer computes them.

An estimator whose only error is sampling noise reaches the dense row's cosine; a biased one stays below it. The
gradient is taken on the HF module in float32 (plain torch); the learner computes the same log-probs (the learner
= HF tests). Everything here imports only torch; sampling and rewards are the caller's (``gradient_cli.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from sparse_rl_megatron.algo.correction import prepare_correction
from sparse_rl_megatron.algo.loss import LossConfig, micro_batch_loss

if TYPE_CHECKING:
    from sparse_rl_megatron.algo import CorrectionConfig
    from sparse_rl_megatron.rollout.sample import Sample


@dataclass(frozen=True)
class Alignment:
    """One gradient against the reference."""

    cosine: float
    """cos(g, g_ref)."""
    norm_ratio: float
    """|g| / |g_ref|."""
    kept_tokens: float
    """Share of the response tokens the loss trained on (after rejection)."""


def response_log_probs(model, samples: Sequence["Sample"], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` log pi(y_t) of each sample's response tokens under ``model`` (carrying the gradient) and the
    ``[B, T]`` bool mask of real response tokens (T = the longest response)."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    longest = max(len(s.response_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        ids[i, :len(seq)] = torch.tensor(seq)
        attention[i, :len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = torch.zeros((len(samples), longest), dtype=torch.bool)
    rows = []
    for i, s in enumerate(samples):
        start, n = len(s.prompt_ids) - 1, len(s.response_ids)
        rows.append(torch.cat([log_probs[i, start:start + n], log_probs.new_zeros(longest - n)]))
        mask[i, :n] = True
    return torch.stack(rows), mask


def policy_gradient(model, samples: Sequence["Sample"], correction: "CorrectionConfig", loss: LossConfig,
                    pad_id: int) -> tuple[torch.Tensor, float]:
    """The flat gradient (over ``model``'s trainable parameters) of the loss the trainer would minimise on
    ``samples`` at step 0 (pi_old = ``model``, reference policy = ``model``), and the share of response tokens kept."""
    model.zero_grad(set_to_none=True)
    current, mask = response_log_probs(model, samples, pad_id)
    old = current.detach()
    sampler = torch.zeros_like(old)
    for i, s in enumerate(samples):
        sampler[i, :len(s.response_ids)] = s.sampler_logprobs.float()
    rewards = torch.tensor([float(s.reward) for s in samples])
    groups = torch.tensor([s.group_id for s in samples])
    batch = prepare_correction(old, sampler, mask, rewards, groups, correction)
    total, _ = micro_batch_loss(current, batch, loss, ref_log_probs=old)
    total.backward()
    grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
             for p in model.parameters() if p.requires_grad]
    kept = float(batch.loss_mask.sum()) / max(float(mask.sum()), 1.0)
    model.zero_grad(set_to_none=True)
    return torch.cat(grads).detach().double(), kept


def align(g: torch.Tensor, reference: torch.Tensor, kept: float) -> Alignment:
    """``g`` against ``reference`` (flat gradients of the same parameters)."""
    norm_ref, norm = float(reference.norm()), float(g.norm())
    cosine = float(g @ reference) / (norm * norm_ref) if norm > 0 and norm_ref > 0 else 0.0
    return Alignment(cosine=cosine, norm_ratio=norm / norm_ref if norm_ref > 0 else float("nan"), kept_tokens=kept)
