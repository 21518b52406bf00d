"""Pushing HF-named weights into SGLang servers: ``tensor`` (in-process), ``distributed``, or ``disk``
(``SGLangWeightTransport``, one per engine, owning the transport's state).

``tensor`` (and ``push_payloads``, the per-TP-rank form a colocated multi-GPU engine takes from its learner
ranks) and ``distributed`` run inside SGLang's weight-update session (``begin_weight_update`` ...
``end_weight_update``, required since 0.5.x). ``distributed`` joins the servers in one process group:
this process is rank 0 and broadcasts each bucket's tensors in order while SGLang's
``update_weights_from_distributed`` receives them (the call is posted first, then the broadcast runs,
as SGLang's own tests and slime do); a server's ranks are ``rank_offset + tp_rank`` (SGLang), so the servers'
offsets follow each one's own TP size as it reports it (``rank_layout``). SGLang serves this call for one DP
replica per server only, and NCCL refuses two ranks of a communicator on one GPU (an engine colocated with
this process); both are refused, naming the alternatives (``NCCL_COLOCATED``). ``disk`` writes a
full HF directory (one safetensors shard per bucket plus the model's config and tokenizer files) and has every
server reload it. Buckets are streamed: only one is held at a time.
Every update carries the new weight version, which SGLang stamps on each later response.
"""
from __future__ import annotations

import contextlib
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch

from sparse_rl_megatron.utils.device import cuda_present
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from sparse_rl_megatron.rollout.sglang_client import HttpClient, InProcessClient
    from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig

GROUP_PREFIX = "sparse_rl_weight_sync"
"""Process-group names are this plus the rendezvous port: unique per engine, in this process and on the servers."""
NCCL_COLOCATED = ("NCCL refuses two ranks of one communicator on one GPU, so distributed NCCL weight sync cannot "
                  "reach an engine on this process's GPU: use weight_sync 'tensor' (in-process engine), 'disk', or "
                  "distributed_backend 'gloo'")


def rank_layout(sizes: list[tuple[int, int, int]]) -> tuple[list[int], int]:
    """(rank offset of every server, world size) of the ``distributed`` group: this process is rank 0, then each
    server's TP ranks. ``sizes``: each server's (tp_size, dp_size, pp_size) as it reports them."""
    offsets, rank = [], 1
    for i, (tp, dp, pp) in enumerate(sizes):
        if dp > 1 or pp > 1:
            raise ValueError(f"SGLang server {i} runs dp_size={dp}, pp_size={pp}: its distributed weight update "
                             "takes one DP replica of TP ranks (rank = rank_offset + tp_rank); start one server per "
                             "replica and list each in urls, or use weight_sync 'disk'")
        offsets.append(rank)
        rank += tp
    return offsets, rank


def widths(info: dict) -> tuple[int, int, int]:
    return int(info.get("tp_size") or 1), int(info.get("dp_size") or 1), int(info.get("pp_size") or 1)


def shares_gpu(info: dict, device: int) -> bool:
    """Does an in-process engine (same CUDA_VISIBLE_DEVICES as this process) run a rank on GPU ``device``?"""
    tp, dp, pp = widths(info)
    first = int(info.get("base_gpu_id") or 0)
    step = int(info.get("gpu_id_step") or 1)
    return device in range(first, first + tp * dp * pp * step, step)


def _check_distributed(transport, infos: list[dict]) -> None:
    """Refuse before any collective what cannot work: NCCL with an in-process engine on this process's GPU."""
    if transport.config.distributed_backend != "nccl" or not transport.client.in_process:
        return
    if cuda_present() and shares_gpu(infos[0], torch.cuda.current_device()):
        raise RuntimeError(f"weight_sync 'distributed' (nccl): the in-process engine runs on this process's GPU "
                           f"{torch.cuda.current_device()}; {NCCL_COLOCATED}")


@contextlib.contextmanager
def _weight_update_session(client):
    """SGLang's weight-update session on every server of ``client``: begun, and ended whatever happens inside."""
    client.call_each("begin_weight_update", [{"selector": "all"}] * client.num_servers)
    try:
        yield
    finally:
        client.call_each("end_weight_update", [{}] * client.num_servers)


class SGLangWeightTransport:
    """Moves HF-named weights into one SGLang engine's servers by its config's ``weight_sync`` (module docstring),
    and owns what that needs between updates: the ``distributed`` process group (made on first use, left by
    ``close``) and the directory of the last ``disk`` update (one model copy on disk at a time)."""

    def __init__(self, config: "SGLangEngineConfig", client: "InProcessClient | HttpClient"):
        self.config, self.client = config, client
        self._group = None
        self._group_name = ""
        self._disk_weights: Path | None = None

    def push(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: str) -> None:
        """Load a stream of buckets of HF-named full tensors (``disk``: every weight) as ``version``."""
        c, client = self.config, self.client
        if c.weight_sync == "disk":
            out = write_hf_dir(buckets, Path(c.weight_sync_dir) / f"v{version}", c.model_path)
            self.reload(out, version)
            previous, self._disk_weights = self._disk_weights, out
            if previous is not None and previous != out:
                shutil.rmtree(previous, ignore_errors=True)  # one model copy on disk at a time
            return
        with _weight_update_session(client):
            if c.weight_sync == "tensor":
                for bucket in buckets:
                    client.update_weights_from_tensor(bucket, version)
            else:
                group = self._process_group()
                for bucket in buckets:
                    body = {"names": [n for n, _ in bucket],
                            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                            "shapes": [list(t.shape) for _, t in bucket], "group_name": self._group_name,
                            "flush_cache": False, "weight_version": version}
                    pending = client.submit_each("update_weights_from_distributed", [body] * client.num_servers)
                    device = "cuda" if c.distributed_backend == "nccl" else "cpu"
                    for _, tensor in bucket:
                        torch.distributed.broadcast(tensor.detach().to(device).contiguous(), src=0, group=group)
                    for future in pending:
                        future.result()

    def push_payloads(self, payloads: Iterable[list], version: str) -> None:
        """In-process engine: load buckets already serialized once per TP rank (ForkingPickler payloads; TP rank r
        opens only ``payloads[k][r]``: on CUDA the IPC handles of the learner rank on its own GPU), inside SGLang's
        weight-update session."""
        with _weight_update_session(self.client):
            for per_rank in payloads:
                self.client.update_weights_from_payloads(list(per_rank), version)

    def reload(self, path, version: str) -> None:
        """Every server reloads the HF directory ``path`` (visible to it) and takes weight version ``version``. The
        radix-cache flush is the engine's, after the update (``SGLangRolloutEngine``: waited for, verified)."""
        self.client.call_each("update_weights_from_disk", [{"model_path": str(path), "weight_version": version,
                                                            "flush_cache": False}] * self.client.num_servers)

    def _process_group(self):
        """The process group with every server's TP ranks (created on first use, named after its port)."""
        if self._group is not None:
            return self._group
        from sglang.srt.utils import init_custom_process_group

        c, client = self.config, self.client
        port = c.master_port or _free_port()
        address = c.master_address or (route_address(c.urls[0]) if c.urls else "127.0.0.1")  # in process: this host
        name = f"{GROUP_PREFIX}_{port}"
        infos = client.server_infos()
        _check_distributed(self, infos)
        offsets, world = rank_layout([widths(i) for i in infos])
        bodies = [{"master_address": address, "master_port": port, "rank_offset": offsets[i],
                   "world_size": world, "group_name": name, "backend": c.distributed_backend}
                  for i in range(client.num_servers)]
        pending = client.submit_each("init_weights_update_group", bodies)
        try:
            group = init_custom_process_group(backend=c.distributed_backend, init_method=f"tcp://{address}:{port}",
                                              world_size=world, rank=0, group_name=name)
            for future in pending:
                future.result()
        except Exception as err:
            if c.distributed_backend == "nccl" and "duplicate gpu" in str(err).lower():
                raise RuntimeError(f"{NCCL_COLOCATED} ({err})") from None
            raise
        self._group, self._group_name = group, name
        return group

    def close(self) -> None:
        """Leave the ``distributed`` sync group (if one was made): the servers drop theirs, this process its own."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            self.client.call_each("destroy_weights_update_group",
                                  [{"group_name": self._group_name}] * self.client.num_servers)
        finally:
            torch.distributed.destroy_process_group(group)


def serialize_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    """One TP rank's payload of a bucket for ``update_weights_from_tensor``: (name, tensor) pairs pickled with
    ForkingPickler, so a CUDA tensor travels as an IPC handle (with its GPU's UUID, SGLang's patch of torch's
    reductions: the receiving scheduler may number its GPUs differently) and a CPU tensor as shared memory: a copy,
    because pickling moves a CPU storage into shared memory in place, and a learner parameter exported as itself
    (a TP 1 view) would then live there (its storage no longer resizable: ``learner/offload.py`` could not put it
    to sleep). The tensors must stay alive until the engine has loaded them."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    if any(t.is_cuda for _, t in bucket):  # the patch handles CUDA tensors only (it breaks CPU ones)
        monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize([(n, t.detach() if t.is_cuda else t.detach().clone())
                                                for n, t in bucket])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def route_address(url: str) -> str:
    """This host's address on the route to the server at ``url`` (what the server can reach it at)."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(parts.hostname or "127.0.0.1"), parts.port or 80))  # no packet is sent
        return s.getsockname()[0]


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
