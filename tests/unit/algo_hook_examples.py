"""Hooks used by test_algo_hooks.py (importable by dotted path: ``algo_hook_examples.<name>``)."""
import torch


def tis_like(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """slime's vanilla TIS shape: pg_loss * clamp(exp(train - rollout), 0, args.tis_clip)."""
    w = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs)).clamp(0, args.tis_clip)
    return pg_loss * w.to(pg_loss.dtype), loss_masks, {"tis": w}


def additive(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """Not multiplicative in pg_loss: refused by mode 'custom'."""
    return pg_loss + 1.0, loss_masks, {}


def wrong_signature(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks):
    return pg_loss, loss_masks, {}


def nan_on_padding(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """Multiplicative on response tokens, NaN on padding (whose values nobody may read)."""
    mask = torch.cat(loss_masks).bool()
    return torch.where(mask, pg_loss * 0.5, torch.full_like(pg_loss, float("nan"))), loss_masks, {}


def veto_odd_samples(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """Drops samples 1, 3, ... whole (a slime-style sequence veto of its own), keeps the others unweighted."""
    masks = [m * 0 if i % 2 else m for i, m in enumerate(loss_masks)]
    vetoed = torch.cat([torch.full((m.numel(),), float(i % 2)) for i, m in enumerate(loss_masks)])
    return pg_loss, masks, {"vetoed_seq": vetoed}


NOT_CALLABLE = 3
