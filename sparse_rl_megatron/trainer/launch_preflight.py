"""``sparse-rl preflight``: check a launch on this node before torchrun starts (``launch/torchrun.sh`` runs it).

    sparse-rl preflight --nnodes 2 --nproc-per-node 8 --rdzv-endpoint head:29500 --config RECIPE [key=value ...]

Checks, each one line on failure (exit 2): the recipe and everything ``sparse-rl train`` checks before loading a
model (model and data present on this node, names, TP x PP against the model and the world size, the rollout
engines' layout, printed as the line the run prints when it starts them); the GPU count
(``--nproc-per-node`` GPUs visible here; the recipe's ``launch.gpus``, when it states one, equal to the world
size); the rendezvous endpoint resolvable, and reachable from the other nodes (retried while the head node
starts). On a machine without GPUs the run uses gloo on CPU, and the GPU checks say so instead of failing.
"""
from __future__ import annotations

import argparse
import socket
import time
from dataclasses import dataclass

from sparse_rl_megatron.utils.errors import UserError

DEFAULT_RDZV_PORT = 29400  # torchrun's c10d default
CONNECT_RETRY_S = 2.0


@dataclass
class LaunchShape:
    """One torchrun launch: ``nnodes`` agents of ``nproc_per_node`` ranks each."""

    nnodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def check_gpus(shape: LaunchShape, visible: int, tp: int, pp: int, expected: int | None) -> str:
    """GPU count vs the launch and the recipe; returns the layout line (TP x PP x DP)."""
    if shape.nnodes < 1 or shape.nproc_per_node < 1:
        raise UserError(f"--nnodes and --nproc-per-node must be >= 1, got {shape.nnodes}, {shape.nproc_per_node}")
    world = shape.world_size
    if world % (tp * pp):
        raise UserError(f"learner.tensor_parallel_size x learner.pipeline_parallel_size = {tp} x {pp} does not "
                        f"divide the world size {world} (--nnodes {shape.nnodes} x --nproc-per-node "
                        f"{shape.nproc_per_node})")
    layout = f"TP {tp} x PP {pp} x DP {world // (tp * pp)} = {world} ranks"
    if visible and shape.nproc_per_node > visible:
        raise UserError(f"--nproc-per-node {shape.nproc_per_node} but only {visible} GPU(s) are visible on "
                        f"{socket.gethostname()} (CUDA_VISIBLE_DEVICES / the Slurm allocation)")
    if expected is not None and expected != world:
        raise UserError(f"the recipe is written for launch.gpus={expected} GPUs, this launch has {world} ranks "
                        f"({layout}); launch {expected}, or set launch.gpus={world} to run it at this size")
    return layout if visible else f"{layout} on CPU (no GPU visible: gloo)"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    if ":" in endpoint:
        host, _, port = endpoint.rpartition(":")
    else:
        host, port = endpoint, str(DEFAULT_RDZV_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--rdzv-endpoint '{endpoint}' must be HOST:PORT")
    return host, int(port)


def _is_local(address: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))  # only an address of this machine can be bound
        return True
    except OSError:
        return False


def check_rendezvous(endpoint: str, timeout_s: float) -> str:
    """The endpoint resolves; from a node other than the head, it accepts connections within ``timeout_s``."""
    host, port = parse_endpoint(endpoint)
    try:
        address = socket.gethostbyname(host)
    except OSError as err:
        raise UserError(f"--rdzv-endpoint {endpoint}: host '{host}' does not resolve on {socket.gethostname()} "
                        f"({err})") from None
    if _is_local(address):
        return f"rendezvous {endpoint} is this node ({address}): torchrun hosts it here"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=CONNECT_RETRY_S):
                return f"rendezvous {endpoint} ({address}) is reachable"
        except OSError as err:
            if time.monotonic() >= deadline:
                raise UserError(f"--rdzv-endpoint {endpoint}: nothing accepts connections at {address}:{port} from "
                                f"{socket.gethostname()} after {timeout_s:g} s ({err}); is the head node's launch "
                                "running, and is the port open between the nodes?") from None
            time.sleep(CONNECT_RETRY_S)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the launch")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks (GPUs) per node")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (multi-node)")
    parser.add_argument("--rdzv-timeout", type=float, default=300.0, help="seconds to wait for a remote endpoint")
    parser.add_argument("--config", default=None, help="the YAML recipe `sparse-rl train` will run")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, as given to `sparse-rl train`")


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.trainer.cli import load
    from sparse_rl_megatron.trainer.run_plan import preflight
    from sparse_rl_megatron.utils.device import DeviceFacts

    cfg = load(args)
    shape = LaunchShape(args.nnodes, args.nproc_per_node)
    facts = DeviceFacts.detect()
    lines = [check_gpus(shape, facts.gpus, cfg.learner.tensor_parallel_size, cfg.learner.pipeline_parallel_size,
                        cfg.launch.gpus)]
    plan = preflight(cfg, shape.world_size, ranks_per_node=shape.nproc_per_node, on_gpu=facts.gpus > 0,
                     device_facts=facts)
    lines.append(f"model {cfg.model_path} and data {cfg.data.dataset} ({len(plan.train_data)} problems) present")
    lines.append(plan.layout.describe())
    if args.rdzv_endpoint:
        lines.append(check_rendezvous(args.rdzv_endpoint, args.rdzv_timeout))
    print(f"[preflight] {socket.gethostname()}: ok: " + "; ".join(lines), flush=True)
    return 0
