"""Sparse-RL correction as a slime custom-TIS hook: drop-in for an existing slime run.

    --use-tis --custom-tis-function-path sparse_rl_megatron.algo.slime_hook.sparse_rl_correction

Options are read from attributes ``sparse_rl_<field>`` of ``args`` for every field of ``CorrectionConfig``
(e.g. ``args.sparse_rl_veto_threshold``, ``args.sparse_rl_weight_upper``); missing or None attributes take
the reference defaults, so the hook works with no extra flags (None means "not set": disable the veto with
``sparse_rl_veto_threshold = 0``). A mode that runs a hook (``custom``) is refused (the hook would call itself).

What this hook does per micro-batch: log rho = train (dense old) - rollout (sampler) log-probs; sequence veto
and token rejection (returned as new ``loss_masks``, so slime drops those tokens from its denominators);
truncated weights multiplied into ``pg_loss``; mean-1 normalisation.

Limits inside slime (our own learner, ``prepare_correction`` + ``micro_batch_loss``, has none of them):

* Normalisation: the hook sees one micro-batch of one rank, so by default it normalises over that
  micro-batch, as the reference did. Pass ``sparse_rl_weight_stats`` (a ``[2]`` ``[sum, count]`` tensor from
  ``reweighting.weight_stats`` summed over the global batch) as a keyword to normalise globally.
* Advantages: slime computes them before the loss, over all samples, so a vetoed sample still shifts its
  group's baseline there.
* Context parallelism: the veto needs whole responses; with CP > 1 the lists are shards and this hook
  refuses to run (``response_lengths`` != list lengths).
"""
from __future__ import annotations

from typing import Any

import torch

from sparse_rl_megatron.algo.config import CorrectionConfig
from sparse_rl_megatron.algo.hooks import pad
from sparse_rl_megatron.algo.metrics import masked_quantiles
from sparse_rl_megatron.algo.modes import CORRECTION_MODES, CorrectionInputs
from sparse_rl_megatron.algo.ratio import sparsity_log_ratio
from sparse_rl_megatron.algo.reweighting import normalisation_factor, weight_stats
from sparse_rl_megatron.algo.validation import check_finite_where
from sparse_rl_megatron.observability import metric_names as MN

ARGS_PREFIX = "sparse_rl_"


def config_from_args(args: Any) -> CorrectionConfig:
    """``CorrectionConfig`` from attributes ``sparse_rl_<field>`` of ``args`` (None/missing: default)."""
    values = {}
    for name in CorrectionConfig.field_names():
        value = getattr(args, ARGS_PREFIX + name, None) if args is not None else None
        if value is not None:
            values[name] = value
    try:
        config = CorrectionConfig(**values)
    except ValueError as err:  # name the attribute the slime user set, not our dataclass field
        raise ValueError(str(err).replace("CorrectionConfig.", f"args.{ARGS_PREFIX}")) from err
    if CORRECTION_MODES.get(config.mode).uses_hook:
        raise ValueError(f"{ARGS_PREFIX}mode='{config.mode}' is not allowed inside the Sparse-RL hook (it would call itself)")
    return config


def sparse_rl_correction(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Sparse-RL rejection + reweighting with slime's custom-TIS hook signature (see the module docstring).

    Args:
        args: options as attributes ``sparse_rl_<CorrectionConfig field>``.
        pg_loss: ``[N]`` per-token policy loss, samples concatenated.
        train_log_probs / rollout_log_probs / loss_masks: one ``[n_i]`` tensor per sample, ``sum n_i = N``:
            dense old log-probs, sampler log-probs, 0/1 masks.
        kwargs: ``response_lengths`` (checked against the lists when given), ``sparse_rl_weight_stats``.

    Returns:
        ``(pg_loss * w, new loss_masks (input dtype), metrics)`` with every metric an ``[N]`` tensor.
    """
    config = config_from_args(args)
    if not (len(train_log_probs) == len(rollout_log_probs) == len(loss_masks)):
        raise ValueError(
            f"per-sample lists differ in length: train_log_probs {len(train_log_probs)}, rollout_log_probs "
            f"{len(rollout_log_probs)}, loss_masks {len(loss_masks)}"
        )
    lengths = [int(t.numel()) for t in train_log_probs]
    for i, (r, m) in enumerate(zip(rollout_log_probs, loss_masks)):
        if r.numel() != lengths[i] or m.numel() != lengths[i]:
            raise ValueError(
                f"sample {i}: train_log_probs has {lengths[i]} tokens, rollout_log_probs {r.numel()}, loss_masks {m.numel()}"
            )
    response_lengths = kwargs.get("response_lengths")
    if response_lengths is not None and list(response_lengths) != lengths:
        raise ValueError(
            "response_lengths differ from the per-sample list lengths (context parallelism?); the Sparse-RL hook "
            f"needs whole responses: {list(response_lengths)} vs {lengths}"
        )
    if pg_loss.dim() != 1 or pg_loss.numel() != sum(lengths):
        raise ValueError(f"pg_loss must be [N] with N = {sum(lengths)} (sum of sample lengths), got {tuple(pg_loss.shape)}")

    old, valid = pad([t.detach() for t in train_log_probs])
    sampler, _ = pad([t.detach().to(old.dtype) for t in rollout_log_probs])
    mask_in, _ = pad([m.to(torch.float32) for m in loss_masks])
    response = valid & (mask_in != 0)
    # checked here under slime's names (index = (sample, token)); sparsity_log_ratio would say old/sampler
    check_finite_where(old, response, "train_log_probs")
    check_finite_where(sampler, response, "rollout_log_probs")
    log_rho = sparsity_log_ratio(old, sampler, response)

    correction = CORRECTION_MODES.get(config.mode)(CorrectionInputs(log_rho, response, old, sampler), config)
    new_mask, vetoed, weights = correction.loss_mask, correction.vetoed, correction.weights
    stats = kwargs.get("sparse_rl_weight_stats")
    stats = weight_stats(weights, new_mask) if stats is None else torch.as_tensor(stats, dtype=torch.float64)
    factor = normalisation_factor(stats.to(weights.device)) if config.normalise_weights else torch.ones((), dtype=torch.float64)
    weights = torch.where(new_mask, weights.double() * factor, torch.zeros((), dtype=torch.float64, device=old.device))

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x[valid].to(device=pg_loss.device, dtype=torch.float32)

    def per_token(value: float) -> torch.Tensor:
        return torch.full((pg_loss.numel(),), value, dtype=torch.float32, device=pg_loss.device)

    rho = torch.exp(log_rho.double())
    n_resp = int(response.sum())
    p1, p5 = masked_quantiles(rho, response, (0.01, 0.05)) if n_resp else (1.0, 1.0)  # no NaN: slime does x * mask
    metrics = {
        MN.SPARSE_RHO: flat(rho),
        MN.SPARSE_REJECTED_TOKEN: flat(response & ~new_mask),
        MN.SPARSE_TOKEN_BELOW: flat(rho < config.rejection_lower),
        MN.SPARSE_TOKEN_ABOVE: flat(rho > config.rejection_upper),
        MN.SPARSE_TRUNCATED: flat(rho > config.weight_upper),
        MN.SPARSE_VETOED_SEQ: flat(vetoed.unsqueeze(-1).expand_as(response)),
        MN.SPARSE_REJECTED_SEQ: flat((~new_mask.any(dim=-1)).unsqueeze(-1).expand_as(response)),
        MN.SPARSE_KL_K1: flat(-log_rho),
        MN.SPARSE_KL_K3: flat(torch.expm1(log_rho) - log_rho),
        MN.SPARSE_WEIGHT: flat(weights),
        MN.SPARSE_WEIGHT_NORM_FACTOR: per_token(float(factor)),
        MN.SPARSE_RHO_P1: per_token(p1),
        MN.SPARSE_RHO_P5: per_token(p5),
    }
    new_masks = [
        (m.to(torch.float32) * new_mask[i, :n].to(torch.float32)).to(m.dtype) for i, (m, n) in enumerate(zip(loss_masks, lengths))
    ]
    return pg_loss * flat(weights).to(pg_loss.dtype), new_masks, metrics
