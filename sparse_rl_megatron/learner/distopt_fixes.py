"""megatron-core 0.16.1's DistributedOptimizer checkpoints, made to save and load: four fixes, on every device.

The learner's bf16 runs use the DistributedOptimizer (the default with CUDA). Saving and loading its state
failed or resumed wrongly in four places, each found by ``bench/gpu_check.py --cpu`` (the same code paths run on
CPU and GPU):

1. The default layout of its state, ``fully_sharded_model_space``, builds flattened-range tensors that
   megatron-core's own dist_checkpointing refuses ("ShardedTensor.flattened_range is not supported").
   ``OPTIMIZER_METADATA`` asks for ``fully_reshardable`` instead, which also loads at any TP x PP x DP.
2. Each param group's main params are ordered [fp32 params, then the fp32 copies of the bf16 ones], but the
   map model param -> (group, position) counts positions in grad-buffer order. In a bf16 model that has fp32
   params (megatron's torch norms in the local layer spec, i.e. any run without Transformer Engine) the map
   picks another parameter's main param and Adam moments: a size mismatch, or for equal sizes swapped state.
   ``fix_main_param_index`` rebuilds the map from the groups as they are.
3. Without Apex or Transformer Engine the optimizer is torch's Adam, whose state holds a per-param ``step``;
   loading restores ``step`` from the param groups and then copies the param state tensor by tensor, asking
   the loaded state for every key of the live state, ``step`` included, which it does not hold (KeyError).
   ``_load_states_it_holds`` copies the keys the loaded state holds.
4. That same load gives every parameter's state one shared ``step`` tensor; torch's Adam then adds 1 to it
   once per parameter and step, so after a resume the bias correction ran on a step count inflated by the
   number of parameters. ``_unshare_steps`` gives each parameter its own copy after a load.

``apply(optimizer)`` is called by ``learner.optimizer.build_optimizer``; it changes only the optimizer it is
given (an instance attribute, no class patch) and is a no-op for other optimizers.
"""
from __future__ import annotations

import types

import torch

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""The ``metadata`` of the optimizer's ``sharded_state_dict`` at save and load (other optimizers ignore it)."""


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, DistributedOptimizer)]


def fix_main_param_index(opt) -> None:
    """Fix 2: ``opt.model_param_group_index_map[p]`` = the position of p's own main param in its group."""
    for group, (fp32, half) in enumerate(zip(opt.model_fp32_groups, opt.model_float16_groups)):
        mains = opt.optimizer.param_groups[group]["params"]
        for position, param in enumerate([*fp32, *half]):
            size = len(opt._get_model_param_range_map(param)["param"])
            if mains[position].numel() != size:
                raise RuntimeError(f"DistributedOptimizer param group {group}: main param {position} has "
                                   f"{mains[position].numel()} elements, its model param's shard {size}")
            opt.model_param_group_index_map[param] = (group, position)


def _load_states_it_holds(self, model_param, tensors) -> None:
    """Fix 3: megatron's ``_set_main_param_and_optimizer_states`` (non precision-aware branch), copying the
    keys of the loaded ``tensors`` (``param``, ``exp_avg``, ``exp_avg_sq``) and leaving ``step`` as loaded."""
    group, position = self.model_param_group_index_map[model_param]
    main = self.optimizer.param_groups[group]["params"][position]
    live = {"param": main, **self.optimizer.state[main]}
    missing = sorted(set(live) - set(tensors) - {"step"})
    if missing:
        raise KeyError(f"DistributedOptimizer checkpoint lacks optimizer state {missing} of a parameter")
    for key, value in tensors.items():
        live[key].copy_(value)


def _unshare_steps(opt) -> None:
    """Fix 4: after megatron's ``load_state_dict``, one ``step`` tensor per parameter state."""
    load = opt.load_state_dict

    def load_state_dict(state_dict):
        load(state_dict)
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    opt.load_state_dict = load_state_dict


def apply(optimizer) -> None:
    """Apply fixes 2-4 to every DistributedOptimizer inside ``optimizer`` (fix 1 is ``OPTIMIZER_METADATA``)."""
    for opt in _distributed_optimizers(optimizer):
        fix_main_param_index(opt)
        _unshare_steps(opt)
        if not opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            opt._set_main_param_and_optimizer_states = types.MethodType(_load_states_it_holds, opt)
