"""Checkpoint names of routed experts -> views into the fused expert tensors transformers keeps in memory.

A Qwen MoE checkpoint (the hub's, ``save_pretrained``'s, the learner's export) names every expert's matrices
(``model.layers.<l>.mlp.experts.<e>.gate_proj.weight``, ``up_proj``, ``down_proj``); transformers >= 5 holds a
layer's experts fused, ``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` (gate rows first, then up) and
``mlp.experts.down_proj`` ``[E, H, F]``, and converts on load. A weight push copies each per-expert tensor into
its slice of the fused one.
"""
from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
PARTS_PER_EXPERT = {"gate_up_proj": 2, "down_proj": 1}
"""How many checkpoint tensors of one expert fill each fused tensor."""


def fused_slice(state: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor] | None:
    """``(fused name, the view of it that checkpoint tensor name fills)``, or None when ``name`` is not a routed
    expert's tensor of a fused layer in ``state``."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    e, proj = int(m.group("e")), m.group("proj")
    fused_name = f"{m.group('layer')}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    fused = state.get(fused_name)
    if fused is None or e >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return fused_name, fused[e]
    half = fused.shape[1] // 2
    return fused_name, fused[e, :half] if proj == "gate_proj" else fused[e, half:]


def fused_coverage(state: dict[str, torch.Tensor], fused_name: str) -> int:
    """How many checkpoint tensors fill the fused tensor ``fused_name`` (experts x parts)."""
    return state[fused_name].shape[0] * PARTS_PER_EXPERT[fused_name.rsplit(".", 1)[1]]
