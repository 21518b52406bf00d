"""``sparse-rl preflight``: the GPU-count and rendezvous checks of a launch, on CPU."""
from __future__ import annotations

import socket

import pytest

from sparse_rl_megatron.trainer.launch_preflight import LaunchShape, check_gpus, check_rendezvous, parse_endpoint
from sparse_rl_megatron.utils.errors import UserError


def test_gpu_count_against_layout_and_recipe():
    assert check_gpus(LaunchShape(2, 8), visible=8, tp=2, pp=2, expected=16) == "TP 2 x PP 2 x DP 4 = 16 ranks"
    assert "on CPU (no GPU visible: gloo)" in check_gpus(LaunchShape(1, 2), visible=0, tp=2, pp=1, expected=None)
    with pytest.raises(UserError, match=r"--nproc-per-node 8 but only 4 GPU\(s\) are visible on "):
        check_gpus(LaunchShape(1, 8), visible=4, tp=1, pp=1, expected=None)
    with pytest.raises(UserError, match=r"= 4 x 1 does not divide the world size 6 \(--nnodes 3 x --nproc-per-node 2\)"):
        check_gpus(LaunchShape(3, 2), visible=2, tp=4, pp=1, expected=None)
    with pytest.raises(UserError, match=r"written for launch.gpus=8 GPUs, this launch has 4 ranks .* set launch.gpus=4"):
        check_gpus(LaunchShape(1, 4), visible=4, tp=1, pp=1, expected=8)


def test_rendezvous_endpoint_checks():
    assert parse_endpoint("node01:29500") == ("node01", 29500)
    assert parse_endpoint("node01") == ("node01", 29400)
    with pytest.raises(UserError, match="must be HOST:PORT"):
        parse_endpoint("node01:http")
    assert "is this node" in check_rendezvous("127.0.0.1:29500", timeout_s=0)
    with pytest.raises(UserError, match=r"host 'no-such-host\.invalid' does not resolve"):
        check_rendezvous("no-such-host.invalid:29500", timeout_s=0)


def test_remote_endpoint_must_accept_connections(monkeypatch):
    import sparse_rl_megatron.trainer.launch_preflight as lc

    monkeypatch.setattr(lc, "_is_local", lambda address: False)  # pretend 127.0.0.1 is another node
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert "is reachable" in check_rendezvous(f"127.0.0.1:{port}", timeout_s=1)
    with pytest.raises(UserError, match=rf"nothing accepts connections at 127.0.0.1:{port} .* after 0 s"):
        check_rendezvous(f"127.0.0.1:{port}", timeout_s=0)
