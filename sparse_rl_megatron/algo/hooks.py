"""Custom correction hooks: ONE fixed keyword signature, identical to slime's ``--custom-tis-function-path``::

    def hook(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs)
        -> (pg_loss, loss_masks, metrics)

* ``args``: the run's options as attributes (slime's argparse namespace; ours: ``CorrectionConfig.hook_args``).
* ``pg_loss``: ``[N]`` per-token policy loss of the micro-batch, all samples' response tokens concatenated.
* ``train_log_probs``: list of ``[n_i]`` DENSE OLD log-probs (pi_old), one per sample, ``sum n_i = N``.
* ``rollout_log_probs``: list of ``[n_i]`` SAMPLER log-probs (pi_sparse).
* ``loss_masks``: list of ``[n_i]`` 0/1 masks.
* ``**kwargs``: slime passes ``total_lengths`` and ``response_lengths``; we pass ``response_lengths``.
* returns the corrected ``pg_loss [N]``, the new masks (rejected tokens 0: they leave the denominator) and
  a dict of ``[N]`` per-token metric tensors (slime averages each with the pre-rejection masks).

``load_hook`` imports a hook by dotted path and checks this signature. ``run_hook_on_batch`` is how OUR
learner uses a hook (mode ``custom``): once per rollout on the global batch with ``pg_loss = 1``, reading
the per-token weight it applies and the mask it returns, so that normalisation, denominators and advantages
stay global. That requires the hook to scale ``pg_loss`` per token (every slime TIS/MIS hook does); it is
checked by calling it again with ``pg_loss = 2``.
"""
from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace
from typing import Any, Callable

import torch

from sparse_rl_megatron.algo.validation import as_bool_mask, check_2d, check_same_shape

HOOK_KEYWORDS = ("pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks")
"""The keyword-only parameters every hook takes (after the positional ``args``)."""
HOOK_SIGNATURE = "fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs)"
PASSED_EXTRA_KWARGS = ("response_lengths",)
"""Extra keywords our learner passes; a hook may declare them as keyword-only parameters."""

CorrectionHook = Callable[..., tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]]


def check_hook_signature(fn: Any, name: str = "hook") -> None:
    """Raise ``TypeError`` unless ``fn`` has exactly the slime custom-TIS hook signature (see module doc)."""
    if not callable(fn):
        raise TypeError(f"{name} is not callable: {fn!r}")
    params = list(inspect.signature(fn).parameters.values())
    problems = []
    if not params or params[0].name != "args" or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        problems.append("first parameter must be 'args' (positional)")
    kw_only = {p.name: p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    missing = [k for k in HOOK_KEYWORDS if k not in kw_only]
    if missing:
        problems.append(f"missing keyword-only parameter(s) {missing}")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        problems.append("must accept **kwargs")
    extra_required = [
        p.name
        for p in params[1:]
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        and p.name not in HOOK_KEYWORDS + PASSED_EXTRA_KWARGS
    ]
    if extra_required:
        problems.append(f"has required parameter(s) nobody passes: {extra_required}")
    if problems:
        raise TypeError(f"{name} has the wrong signature ({'; '.join(problems)}); expected {HOOK_SIGNATURE}")


def load_hook(path: str) -> CorrectionHook:
    """Import ``package.module.function`` and check its signature; errors say what was wrong."""
    if not isinstance(path, str) or "." not in path.strip("."):
        raise ValueError(f"hook path must be a dotted path 'package.module.function', got {path!r}")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import module '{module_name}' of hook path '{path}': {exc}") from exc
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise AttributeError(f"module '{module_name}' has no function '{attr}' (hook path '{path}'); it defines: {public}")
    fn = getattr(module, attr)
    check_hook_signature(fn, name=f"hook '{path}'")
    return fn


def unpad(padded: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """``[B, T]`` -> list of ``[n_i]`` (the first ``n_i`` entries of each row)."""
    return [padded[i, :n] for i, n in enumerate(lengths)]


def pad(per_sample: list[torch.Tensor], fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """List of ``[n_i]`` -> ``([B, max n_i] padded with fill, [B, max n_i] bool validity)``."""
    if not per_sample:
        raise ValueError("expected at least one sample")
    lengths = [int(t.numel()) for t in per_sample]
    width = max(lengths)
    ref = per_sample[0]
    out = torch.full((len(per_sample), width), fill, dtype=ref.dtype, device=ref.device)
    valid = torch.zeros((len(per_sample), width), dtype=torch.bool, device=ref.device)
    for i, t in enumerate(per_sample):
        if t.dim() != 1:
            raise ValueError(f"sample {i}: expected a 1-D tensor, got shape {tuple(t.shape)}")
        out[i, : lengths[i]] = t
        valid[i, : lengths[i]] = True
    return out, valid


def run_hook_on_batch(
    hook: CorrectionHook,
    args: Any,
    old_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Read a hook's per-token weights and mask on a padded global batch.

    Args:
        hook: a function with the hook signature; args: passed through (a dict becomes a namespace).
        old_log_probs, sampler_log_probs, response_mask: ``[B, T]``.

    Returns:
        ``(weights [B, T], loss_mask [B, T] bool, metrics)``; metrics are the token-means of the hook's
        per-token metric tensors over the original response mask, keyed ``hook/<name>``.
    """
    check_2d(old_log_probs, "old_log_probs")
    check_same_shape("old_log_probs", old_log_probs, sampler_log_probs=sampler_log_probs, response_mask=response_mask)
    mask = as_bool_mask(response_mask, "response_mask")
    if isinstance(args, dict):
        args = SimpleNamespace(**args)
    # hand the hook full rows (the padded width) so that positions line up; the mask marks real tokens
    lengths = [old_log_probs.shape[1]] * old_log_probs.shape[0]
    flat_mask = mask.reshape(-1)
    clean_old = torch.where(mask, old_log_probs, torch.zeros_like(old_log_probs))
    clean_sampler = torch.where(mask, sampler_log_probs, torch.zeros_like(sampler_log_probs))

    def call(scale: float):
        return hook(
            args,
            pg_loss=torch.full((flat_mask.numel(),), scale, dtype=torch.float64, device=old_log_probs.device),
            train_log_probs=unpad(clean_old, lengths),
            rollout_log_probs=unpad(clean_sampler, lengths),
            loss_masks=unpad(mask.to(torch.int32), lengths),
            response_lengths=lengths,
        )

    out1, masks1, metrics = call(1.0)
    out2, masks2, _ = call(2.0)
    for out in (out1, out2):
        if out.shape != flat_mask.shape:
            raise ValueError(f"hook returned pg_loss of shape {tuple(out.shape)}, expected {tuple(flat_mask.shape)}")
    # only response tokens are read: padding may hold anything (e.g. NaN from a 0/0 on an empty sample)
    if not torch.allclose(out2.double()[flat_mask], 2 * out1.double()[flat_mask], rtol=1e-6, atol=1e-12):
        raise ValueError("hook is not per-token multiplicative in pg_loss (f(2) != 2 f(1)); mode 'custom' needs a "
                         "hook of the form pg_loss * weights")
    new_mask = torch.stack([as_bool_mask(m, "hook loss_masks") for m in masks1]) & mask
    weights = torch.where(new_mask, out1.reshape(mask.shape), torch.zeros_like(out1).reshape(mask.shape))
    if not bool(torch.isfinite(weights).all()):
        raise ValueError("hook produced non-finite weights on kept tokens")
    n = int(mask.sum())
    summary = {}
    for key, value in (metrics or {}).items():
        if isinstance(value, (list, tuple)):  # per-sample lists (slime's MIS example style)
            value = torch.cat([torch.as_tensor(v).reshape(-1) for v in value]) if value else torch.zeros(0)
        value = torch.as_tensor(value, device=mask.device).reshape(-1).to(torch.float64)
        if value.numel() == flat_mask.numel():
            summary[f"hook/{key}"] = float(value[flat_mask].sum() / n) if n else 0.0
        elif value.numel() == 1:
            summary[f"hook/{key}"] = float(value)
    return weights.to(old_log_probs.dtype).detach(), new_mask, summary
