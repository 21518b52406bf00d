"""Routing replay (R3, ``learner.moe.routing_replay``) in the learner against the HF engine: the sampler's recorded
experts, or forced other ones, drive the dense recompute and the training forward (``workers/w_replay.py``, one
process, both tiny MoE families)."""
import pytest

from mcore_harness import launch

FAMILIES = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module")
def replay_launch(tmp_path_factory):
    work = tmp_path_factory.mktemp("replay")
    return launch("w_replay.py", 1, [str(work)], work / "results", timeout=400)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("check", ["setup", "own", "forced", "train"])
def test_routing_replay(replay_launch, family, check):
    replay_launch.check(f"{check}_{family}")
