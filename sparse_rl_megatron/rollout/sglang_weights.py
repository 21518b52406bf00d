"""Pushing HF-named weights into SGLang servers: ``tensor`` (in-process), ``distributed``, or ``disk``.

``tensor`` (and ``push_payloads``, the per-TP-rank form a colocated multi-GPU engine takes from its learner
ranks) and ``distributed`` run inside SGLang's weight-update session (``begin_weight_update`` ...
``end_weight_update``, required since 0.5.x). ``distributed`` joins the servers in one process group:
this process is rank 0 and broadcasts each bucket's tensors in order while SGLang's
``update_weights_from_distributed`` receives them (the call is posted first, then the broadcast runs,
as SGLang's own tests and slime do); server i's TP ranks are ``1 + i * tp_size ...``. ``disk`` writes a
full HF directory (one safetensors shard per bucket plus the model's config and tokenizer files) and has every
server reload it. Buckets are streamed: only one is held at a time.
Every update carries the new weight version, which SGLang stamps on each later response.
"""
from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Iterable

import torch

GROUP_PREFIX = "sparse_rl_weight_sync"
"""Process-group names are this plus the rendezvous port: unique per engine, in this process and on the servers."""


def push_weights(engine, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: str) -> None:
    c = engine.config
    if c.weight_sync == "disk":
        out = write_hf_dir(buckets, Path(c.weight_sync_dir) / f"v{version}", c.model_path)
        reload_from_disk(engine.client, out, version)
        previous, engine._disk_weights = getattr(engine, "_disk_weights", None), out
        if previous is not None and previous != out:
            shutil.rmtree(previous, ignore_errors=True)  # one model copy on disk at a time
        return
    client = engine.client
    client.call_each("begin_weight_update", [{"selector": "all"}] * client.num_servers)
    try:
        if c.weight_sync == "tensor":
            for bucket in buckets:
                client.update_weights_from_tensor(bucket, version)
        else:
            group = _process_group(engine)
            for bucket in buckets:
                body = {"names": [n for n, _ in bucket],
                        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                        "shapes": [list(t.shape) for _, t in bucket], "group_name": engine._weight_group_name,
                        "flush_cache": False, "weight_version": version}
                pending = client.submit_each("update_weights_from_distributed", [body] * client.num_servers)
                device = "cuda" if c.distributed_backend == "nccl" else "cpu"
                for _, tensor in bucket:
                    torch.distributed.broadcast(tensor.detach().to(device).contiguous(), src=0, group=group)
                for future in pending:
                    future.result()
    finally:
        client.call_each("end_weight_update", [{}] * client.num_servers)


def push_payloads(engine, payloads: Iterable[list], version: str) -> None:
    """In-process engine: load buckets already serialized once per TP rank (ForkingPickler payloads; TP rank r
    opens only ``payloads[k][r]``: on CUDA the IPC handles of the learner rank on its own GPU), inside SGLang's
    weight-update session."""
    client = engine.client
    client.call_each("begin_weight_update", [{"selector": "all"}])
    try:
        for per_rank in payloads:
            client.update_weights_from_payloads(list(per_rank), version)
    finally:
        client.call_each("end_weight_update", [{}])


def serialize_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    """One TP rank's payload of a bucket for ``update_weights_from_tensor``: (name, tensor) pairs pickled with
    ForkingPickler, so a CUDA tensor travels as an IPC handle (with its GPU's UUID, SGLang's patch of torch's
    reductions: the receiving scheduler may number its GPUs differently) and a CPU tensor as shared memory. The
    tensors must stay alive until the engine has loaded them."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    if any(t.is_cuda for _, t in bucket):  # the patch handles CUDA tensors only (it breaks CPU ones)
        monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize([(n, t.detach()) for n, t in bucket])


def reload_from_disk(client, path, version: str) -> None:
    """Every server reloads the HF directory ``path`` (visible to it) and takes weight version ``version``."""
    client.call_each("update_weights_from_disk", [{"model_path": str(path), "weight_version": version}]
                     * client.num_servers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def route_address(url: str) -> str:
    """This host's address on the route to the server at ``url`` (what the server can reach it at)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url if "//" in url else f"http://{url}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(parts.hostname or "127.0.0.1"), parts.port or 80))  # no packet is sent
        return s.getsockname()[0]


def _process_group(engine):
    """The process group with every server's TP ranks (created on first use, named after its port)."""
    if getattr(engine, "_weight_group", None) is not None:
        return engine._weight_group
    from sglang.srt.utils import init_custom_process_group

    c = engine.config
    port = c.master_port or _free_port()
    address = c.master_address or (route_address(c.urls[0]) if c.urls else "127.0.0.1")  # in process: this host
    name = f"{GROUP_PREFIX}_{port}"
    world = 1 + engine.client.num_servers * c.tp_size
    bodies = [{"master_address": address, "master_port": port, "rank_offset": 1 + i * c.tp_size,
               "world_size": world, "group_name": name, "backend": c.distributed_backend}
              for i in range(engine.client.num_servers)]
    pending = engine.client.submit_each("init_weights_update_group", bodies)
    group = init_custom_process_group(backend=c.distributed_backend, init_method=f"tcp://{address}:{port}",
                                      world_size=world, rank=0, group_name=name)
    for future in pending:
        future.result()
    engine._weight_group, engine._weight_group_name = group, name
    return group


def close_process_group(engine) -> None:
    """Leave the ``distributed`` sync group (if one was made): the servers drop theirs, this process its own."""
    group = getattr(engine, "_weight_group", None)
    if group is None:
        return
    engine._weight_group = None
    try:
        engine.client.call_each("destroy_weights_update_group",
                                [{"group_name": engine._weight_group_name}] * engine.client.num_servers)
    finally:
        torch.distributed.destroy_process_group(group)


def write_hf_dir(buckets: Iterable[list[tuple[str, torch.Tensor]]], out: Path, model_path: str) -> Path:
    """An HF model directory: each bucket as ``model-<k>.safetensors`` (SGLang loads every shard of a directory
    without an index) plus ``model_path``'s other files."""
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in Path(model_path).iterdir():
        if item.is_file() and not item.name.startswith("model") and item.suffix != ".safetensors":
            shutil.copy2(item, out / item.name)
    for k, bucket in enumerate(buckets):
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in bucket}
        save_file(tensors, str(out / f"model-{k:05d}.safetensors"))
    return out
