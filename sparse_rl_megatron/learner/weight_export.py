"""Export the current weights as full HF-named tensors, in buckets (for weight sync and HF export).

Every rank of the TP x PP grid takes part and every rank receives every bucket:
TP shards are all-gathered and merged by ``weight_map.mcore_to_hf``; the pipeline stage that owns a
bucket broadcasts it (one flat buffer per bucket) to the other stages. Padded vocabulary rows are dropped,
and with tied embeddings only ``model.embed_tokens.weight`` is sent (like HF's own checkpoints).

Routed experts (mixtures of experts) are held by one expert-parallel rank each and split over the expert
tensor-parallel ranks: their shards are all-gathered over the expert TP group, and within the owner stage each
expert-parallel rank broadcasts the experts of the bucket it holds (one flat buffer per rank) to its EP group,
before the bucket goes to the other stages as a whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from sparse_rl_megatron.learner.model_provider import expert_offset, layer_offset_of, unwrap
from sparse_rl_megatron.models import weight_map as wm
from sparse_rl_megatron.models.arch import ModelArch

Bucket = list[tuple[str, torch.Tensor]]

# Default bucket size: large enough that per-bucket overheads (one broadcast, one engine call) vanish,
# small enough to stay a rounding error next to the model (slime uses 512 MB buckets for SGLang sync).
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class _Item:
    name: str  # canonical Megatron name
    owner_stage: int
    hf: tuple[tuple[str, tuple[int, ...]], ...]  # (hf_name, full shape)
    owner_ep: int | None = None  # routed experts: the expert-parallel rank that holds it; None: every rank

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for _, s in self.hf)


def _plan(arch: ModelArch, names_by_stage: list[list[str]], ep: int = 1) -> list[_Item]:
    """Every exported parameter with its owner stage (and owner EP rank for a routed expert, which only that EP
    rank of its layer's stage holds: the stage is its layer's router's)."""
    shapes = wm.expected_hf_shapes(arch)
    owner = {}
    for stage, names in enumerate(names_by_stage):
        for n in names:
            owner.setdefault(n, stage)
    per_rank = arch.moe.num_experts // ep if arch.moe is not None else 0
    items = []
    for n in wm.mcore_param_names(arch):
        if n == wm.OUTPUT_LAYER and arch.tie_word_embeddings:
            continue  # the tied head is the embedding, exported once from the first stage
        expert = wm.expert_index(n)
        stage = owner.get(f"decoder.layers.{wm.layer_index(n)}.mlp.router.weight") if expert is not None else owner.get(n)
        if stage is None:
            raise RuntimeError(f"no pipeline stage holds parameter '{n}'")
        items.append(_Item(n, stage, tuple((h, shapes[h]) for h in wm.hf_names(arch, n)),
                           None if expert is None else expert // per_rank))
    return items


def _buckets(items: list[_Item], bucket_bytes: int, itemsize: int) -> list[list[_Item]]:
    out: list[list[_Item]] = []
    size = 0
    for it in items:
        nbytes = it.numel * itemsize
        if out and out[-1][0].owner_stage == it.owner_stage and size + nbytes <= bucket_bytes:
            out[-1].append(it)
            size += nbytes
        else:
            out.append([it])
            size = nbytes
    return out


def _local_hf_tensors(arch: ModelArch, params: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    p = params[name].detach()
    kind = wm.param_kind(name)
    if kind in wm.EXPERT_KINDS:
        tp, group = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group()
    else:
        tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    if kind == "replicated" or tp == 1:
        shards = [p]
    else:
        shards = [torch.empty_like(p) for _ in range(tp)]
        dist.all_gather(shards, p.contiguous(), group=group)
    return wm.mcore_to_hf(arch, name, shards)


@torch.no_grad()
def export_hf_buckets(
    model, arch: ModelArch, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None
) -> Iterator[Bucket]:
    """Yield lists of ``(hf_name, full tensor)`` of at most ~``bucket_bytes`` each (a single larger tensor
    gets its own bucket). Collective: every rank of the model-parallel group must iterate to the end.
    ``dtype`` casts the exported tensors (e.g. bf16 for the rollout engine); default: the model's
    ``params_dtype`` (the same on every stage, whatever dtype single parameters such as norms are kept in).
    """
    from megatron.core import parallel_state as ps

    inner = unwrap(model)
    offset, experts_from = layer_offset_of(inner), expert_offset(inner)
    params = {wm.canonical_name(n, offset, experts_from): p for n, p in inner.named_parameters()}
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp > 1:
        names_by_stage: list[list[str]] = [None] * pp  # type: ignore[list-item]
        dist.all_gather_object(names_by_stage, sorted(params), group=ps.get_pipeline_model_parallel_group())
    else:
        names_by_stage = [sorted(params)]
    # One dtype for every stage, so all stages plan the same buckets: megatron keeps some parameters in
    # another dtype than the rest (the torch norms stay fp32 in a bf16 model), so no parameter decides it.
    out_dtype = dtype or inner.config.params_dtype
    stage = ps.get_pipeline_model_parallel_rank()
    device = next(iter(params.values())).device
    ep = ps.get_expert_model_parallel_world_size() if arch.moe is not None else 1
    items = _plan(arch, names_by_stage, ep)
    for bucket in _buckets(items, bucket_bytes, torch.tensor([], dtype=out_dtype).element_size()):
        owner = bucket[0].owner_stage
        tensors = _own_bucket(arch, params, bucket, out_dtype, device) if owner == stage else None
        if pp > 1:
            tensors = _broadcast_bucket(bucket, tensors, owner, out_dtype, device)
        yield tensors
        del tensors  # the consumer holds the bucket as long as it needs it; nothing here keeps it alive


def _own_bucket(arch: ModelArch, params: dict[str, torch.Tensor], bucket: list[_Item], dtype: torch.dtype,
                device: torch.device) -> Bucket:
    """The HF tensors of a bucket this stage holds (TP shards gathered; routed experts from their EP ranks)."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank() if any(it.owner_ep is not None for it in bucket) else 0
    built: dict[str, torch.Tensor] = {}
    for it in bucket:
        if it.owner_ep is None or it.owner_ep == ep_rank:
            hf = _local_hf_tensors(arch, params, it.name)
            built.update((h, hf[h].to(dtype)) for h, _ in it.hf)
    owners = sorted({it.owner_ep for it in bucket if it.owner_ep is not None})
    if owners and ps.get_expert_model_parallel_world_size() > 1:
        group = ps.get_expert_model_parallel_group()
        for r in owners:  # each EP rank's experts of this bucket, one flat buffer
            part = [(h, shape) for it in bucket if it.owner_ep == r for h, shape in it.hf]
            if r == ep_rank:
                flat = torch.cat([built[h].reshape(-1) for h, _ in part])
            else:
                flat = torch.empty(sum(int(torch.Size(s).numel()) for _, s in part), dtype=dtype, device=device)
            dist.broadcast(flat, src=dist.get_global_rank(group, r), group=group)
            if r != ep_rank:
                pos = 0
                for h, shape in part:
                    n = int(torch.Size(shape).numel())
                    built[h] = flat[pos:pos + n].view(shape)
                    pos += n
    return [(h, built[h]) for it in bucket for h, _ in it.hf]


def _broadcast_bucket(bucket: list[_Item], tensors: Bucket | None, owner: int, dtype: torch.dtype,
                      device: torch.device) -> Bucket:
    """The owner stage's bucket on every stage: one flat buffer broadcast over the pipeline group, viewed back."""
    from megatron.core import parallel_state as ps

    if tensors is not None:
        flat = torch.cat([t.reshape(-1) for _, t in tensors])
    else:
        flat = torch.empty(sum(it.numel for it in bucket), dtype=dtype, device=device)
    group = ps.get_pipeline_model_parallel_group()
    dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group)
    if tensors is not None:
        return tensors
    out, pos = [], 0
    for it in bucket:
        for h, shape in it.hf:
            n = int(torch.Size(shape).numel())
            out.append((h, flat[pos:pos + n].view(shape)))
            pos += n
    return out
