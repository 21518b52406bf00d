"""``DeviceTurns``: each turn leaves on the device what its table row says, frees before it takes, and refuses to give
the engines back weights a learner turn released without a push in between."""
from __future__ import annotations

import pytest

from sparse_rl_megatron.learner.offload import OFFLOAD_MODES, OFFLOAD_PARTS
from sparse_rl_megatron.rollout.engine_protocol import ENGINE_MEMORY_PARTS
from sparse_rl_megatron.learner.turns import ENGINE_PARTS, TURNS
from sparse_rl_megatron.trainer.runtime.device_turns import DeviceTurns


class FakeLearner:
    """Tracks its asleep parts as ``Learner`` does (only the mode's parts can sleep) and logs every change."""

    def __init__(self, name: str, mode: str, log: list, parts=OFFLOAD_PARTS):
        self.name, self.log = name, log
        self.may_sleep = OFFLOAD_MODES.get(mode).parts & set(parts)
        self.asleep_parts: frozenset[str] = frozenset()

    def sleep(self, parts=None):
        todo = self.may_sleep & set(OFFLOAD_PARTS if parts is None else parts) - self.asleep_parts
        if todo:
            self.log.append(("sleep", self.name, tuple(sorted(todo))))
            self.asleep_parts |= todo
        return {}

    def wake(self, parts=None):
        todo = self.asleep_parts & set(OFFLOAD_PARTS if parts is None else parts)
        if todo:
            self.log.append(("wake", self.name, tuple(sorted(todo))))
            self.asleep_parts -= todo


class FakePool:
    def __init__(self, log: list):
        self.log = log

    def release_memory(self, parts=ENGINE_MEMORY_PARTS):
        self.log.append(("release", "engines", tuple(parts)))

    def resume_memory(self, parts=ENGINE_MEMORY_PARTS):
        self.log.append(("resume", "engines", tuple(parts)))


def _turns(mode: str = "all"):
    log: list = []
    policy, ref = FakeLearner("policy", mode, log), FakeLearner("reference", mode, log, parts=("weights",))
    turns = DeviceTurns(policy, ref)
    turns.start_engines(lambda: FakePool(log))
    return turns, policy, ref, log


def test_each_turn_leaves_what_its_row_says_awake():
    turns, policy, ref, log = _turns("all")
    assert policy.asleep_parts == set(OFFLOAD_PARTS) and ref.asleep_parts == {"weights"}
    assert log == [("sleep", "policy", ("gradients", "optimizer", "weights")), ("sleep", "reference", ("weights",))]
    for turn in ("recompute", "train", "sync", "engines", "recompute", "train", "sync", "engines"):
        turns.enter(turn)
        needs = TURNS[turn]
        assert set(OFFLOAD_PARTS) - policy.asleep_parts == set(needs.policy), turn
        assert {"weights"} - ref.asleep_parts == set(needs.reference), turn
        assert turns.engine_parts == set(needs.engines), turn


def test_a_step_frees_before_it_takes():
    turns, _, _, log = _turns("all")
    del log[:]
    turns.enter("recompute")
    assert log == [("release", "engines", ("weights", "kv_cache")), ("wake", "policy", ("weights",)),
                   ("wake", "reference", ("weights",))]
    del log[:]
    turns.enter("train")  # the reference's weights go before the policy's gradients and optimizer come
    assert log == [("sleep", "reference", ("weights",)), ("wake", "policy", ("gradients", "optimizer"))]
    del log[:]
    turns.enter("sync")  # the policy's training state goes before the engines' weights come back
    assert log == [("sleep", "policy", ("gradients", "optimizer")), ("resume", "engines", ("weights",))]
    del log[:]
    turns.enter("engines")
    assert log == [("sleep", "policy", ("weights",)), ("resume", "engines", ("kv_cache",))]
    del log[:]
    turns.enter("engines")  # the turn already held: nothing moves
    assert log == []


def test_offload_none_moves_only_the_engines():
    turns, policy, ref, log = _turns("none")
    for turn in ("recompute", "train", "sync", "engines"):
        turns.enter(turn)
        assert not policy.asleep_parts and not ref.asleep_parts
    assert {entry[1] for entry in log} == {"engines"}


def test_optimizer_mode_keeps_the_weights_and_gradients_on_the_device():
    turns, policy, ref, _ = _turns("optimizer")
    assert policy.asleep_parts == {"optimizer"} and not ref.asleep_parts
    turns.enter("recompute")
    assert policy.asleep_parts == {"optimizer"}
    turns.enter("train")
    assert not policy.asleep_parts


def test_released_engine_weights_come_back_only_through_a_sync():
    turns, _, _, log = _turns("all")
    turns.enter("train")  # e.g. a checkpoint load at start-up: the engines' weights are released
    with pytest.raises(RuntimeError, match="enter the sync turn and push the weights before the engines turn"):
        turns.enter("engines")
    turns.enter("sync")
    turns.enter("engines")
    assert turns.engine_parts == set(ENGINE_MEMORY_PARTS)
    turns.enter("sync")  # from the engines: their weights were never released, the KV pool is
    assert log[-2:] == [("release", "engines", ("kv_cache",)), ("wake", "policy", ("weights",))]
    turns.enter("engines")  # allowed: nothing released the weights since


def test_unknown_turn_is_refused_with_the_valid_ones():
    turns, *_ = _turns()
    with pytest.raises(ValueError, match="unknown turn 'decode'; valid: engines, recompute, train, sync"):
        turns.enter("decode")


def test_turn_tables_name_only_real_parts():
    for needs in TURNS.values():
        assert set(needs.engines) <= set(ENGINE_MEMORY_PARTS)
        assert set(needs.policy) <= set(OFFLOAD_PARTS) and set(needs.reference) <= {"weights"}
    assert ENGINE_PARTS == ENGINE_MEMORY_PARTS
