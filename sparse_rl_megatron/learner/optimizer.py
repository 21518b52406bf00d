"""Megatron DDP + optimizer + LR schedule for the learner, and the non-finite guard.

``get_megatron_optimizer`` gives ``FP32Optimizer`` for fp32 parameters (the CPU path) and, with bf16
parameters and ``use_distributed_optimizer``, the ``DistributedOptimizer`` (fp32 main weights sharded over
data-parallel ranks; the GPU path). Grad clipping is Megatron's (``OptimizerConfig.clip_grad``).
Gradients are summed, not averaged, over data-parallel ranks (``calculate_per_token_loss``): the loss is
already normalised by global counts.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from sparse_rl_megatron.learner import cpu_compat, distopt_fixes
from sparse_rl_megatron.learner.config import LearnerConfig
from sparse_rl_megatron.learner.parallel import device
from sparse_rl_megatron.utils.device import DeviceFacts, resolve


@cpu_compat.in_device_mode
def wrap_ddp(model, config: LearnerConfig, facts: DeviceFacts | None = None):
    """Megatron ``DistributedDataParallel`` around the stage model; wires the schedule's grad hooks. ``facts``:
    the learner's device (default: this machine)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    facts = resolve(facts)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        # on CUDA the grad reduce of each bucket starts as soon as its grads are ready in the last micro-batch's
        # backward (megatron's DDP hooks; the schedule's no_sync holds it for the others); CPU runs it at the end
        overlap_grad_reduce=facts.cuda,
        use_distributed_optimizer=config.distributed_optimizer(facts),
        check_for_nan_in_grad=False,  # the learner's own guard skips the step instead of raising
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


@cpu_compat.in_device_mode
def build_optimizer(ddp, config: LearnerConfig, facts: DeviceFacts | None = None):
    """``(optimizer, scheduler)`` for the DDP-wrapped model; ``facts``: the learner's device (default: this machine)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = config.optim
    if o.lr_decay_steps is None:
        raise ValueError("OptimConfig.lr_decay_steps is None (the run's length): resolve it with "
                         "OptimConfig.for_run(optimizer_steps) before building the optimizer")
    facts = resolve(facts)
    dtype = config.torch_params_dtype(facts)
    kwargs: dict[str, Any] = dict(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16,
        params_dtype=dtype, use_distributed_optimizer=config.distributed_optimizer(facts),
    )
    valid = {f.name for f in dataclasses.fields(OptimizerConfig)}
    unknown = sorted(set(config.optimizer_overrides) - valid)
    if unknown:
        raise ValueError(f"optimizer_overrides {unknown} are not OptimizerConfig fields; valid: {', '.join(sorted(valid))}")
    kwargs.update(config.optimizer_overrides)
    opt_config = OptimizerConfig(**kwargs)
    # W7: on CPU the DistributedOptimizer checks parameter types against torch.cuda.* names at construction.
    ctx = cpu_compat.pretend_cuda_tensor_types() if opt_config.use_distributed_optimizer else _null()
    with ctx:
        optimizer = get_megatron_optimizer(opt_config, [ddp])
    distopt_fixes.apply(optimizer)  # megatron-core 0.16.1's DistributedOptimizer checkpoints (see there)
    ddp.module.config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.lr_warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_steps,
        lr_decay_steps=o.lr_decay_steps,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=o.lr_decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _local_grads(ddp) -> list[torch.Tensor]:
    grads = []
    for p in ddp.module.parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is not None:
            grads.append(g)
    return grads


@torch.no_grad()
def all_finite(ddp, local_loss: torch.Tensor) -> bool:
    """True if the loss and every gradient on every rank are finite (one all-reduce over the world).

    Called after the schedule reduced the grads, before the optimizer step; all ranks get the same answer,
    so they all skip (or all take) the step together.
    """
    grads = _local_grads(ddp)
    ok = bool(torch.isfinite(local_loss).all())
    if ok and grads:
        ok = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
    flag = torch.tensor([0.0 if ok else 1.0], device=device())  # NCCL reduces device tensors only
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag) == 0.0
