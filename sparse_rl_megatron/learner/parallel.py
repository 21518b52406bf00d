"""torch.distributed + megatron-core parallel state for the learner (TP x PP x DP, and for a mixture of experts
the expert grid expert-TP x EP x expert-DP x PP over the same ranks).

Under ``torchrun`` the process group comes from the environment; a plain single process gets a world of
one on a free local port. gloo on CPU (with ``cpu_compat`` applied), NCCL on GPU.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparse_rl_megatron.learner import cpu_compat
from sparse_rl_megatron.utils.device import DeviceFacts, cuda_present, resolve

# A collective that has not finished after this long is a hang (a rank died or diverged); fail loudly
# rather than wait for the default 30 minutes.
DEFAULT_TIMEOUT_S = 600


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the TP x PP x DP grid."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    rank: int
    world_size: int
    ep: int = 1
    """Expert-parallel size (routed experts split over this many ranks of a pipeline stage)."""
    etp: int = 1
    """Expert tensor-parallel size (each routed expert's matrices split over this many ranks)."""
    ep_rank: int = 0
    etp_rank: int = 0


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(timeout_s: int = DEFAULT_TIMEOUT_S, facts: DeviceFacts | None = None) -> None:
    """Join (or create, for a single process) the default process group: NCCL when ``facts`` (default: this
    machine) has CUDA, else gloo. Idempotent."""
    if dist.is_initialized():
        return
    cuda = resolve(facts).cuda
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
    )


@cpu_compat.in_device_mode
def init_model_parallel(tp: int, pp: int, seed: int = 1234, timeout_s: int = DEFAULT_TIMEOUT_S,
                        facts: DeviceFacts | None = None, ep: int = 1, etp: int | None = None) -> ParallelLayout:
    """Initialise (or re-initialise at another layout) megatron-core's parallel state (the process group's
    backend from ``facts``, default: this machine).

    The world size must be a multiple of ``tp * pp``; the quotient is the data-parallel size. ``ep`` (expert
    parallel) x ``etp`` (expert tensor parallel; None: ``tp``, as megatron-core) must divide ``world / pp``.
    """
    cpu_compat.apply()
    init_process_group(timeout_s, facts)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} must divide the world size {world}"
        )
    etp = tp if etp is None else etp
    if ep < 1 or etp < 1 or (world // pp) % (ep * etp):
        raise ValueError(
            f"expert_parallel_size={ep} x expert_tensor_parallel_size={etp} must divide world size / "
            f"pipeline_parallel_size = {world} / {pp} = {world // pp} (the ranks of one pipeline stage)"
        )
    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size() == tp
                and ps.get_pipeline_model_parallel_world_size() == pp
                and ps.get_expert_model_parallel_world_size() == ep
                and ps.get_expert_tensor_parallel_world_size() == etp)
        if not same:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return current_layout()


def current_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
    )


def device() -> torch.device:
    """The device this rank computes on: its GPU when ``cuda_present()``, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_present() else torch.device("cpu")
