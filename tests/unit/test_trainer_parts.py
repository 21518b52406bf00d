"""Pieces of the trainer that need no model: prompt order, checkpoint bookkeeping, stop requests, metric
aggregation over optimizer steps, and the ``task:<name>`` model wiring (with a small Task defined here)."""
from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from sparse_rl_megatron.trainer.checkpointing import checkpoints as C
from sparse_rl_megatron.trainer.optimize import aggregate
from sparse_rl_megatron.trainer.runtime.prompts import PromptOrder
from sparse_rl_megatron.trainer.runtime.signals import StopRequest
from sparse_rl_megatron.utils.errors import UserError


def test_prompt_order_resumes_exactly_and_visits_each_problem_once_per_epoch():
    records = list(range(10))
    whole = PromptOrder(records, seed=3)
    taken = [whole.take(4) for _ in range(5)]  # 20 problems: two epochs
    assert sorted(sum(taken[:2], []) + taken[2][:2]) == records and taken[0] != records[:4]
    first = PromptOrder(records, seed=3)
    head = [first.take(4) for _ in range(2)]
    second = PromptOrder(records, seed=3)
    assert second.load_state_dict(first.state_dict()) == []
    assert head + [second.take(4) for _ in range(3)] == taken
    assert PromptOrder(records, seed=3, shuffle=False).take(3) == [0, 1, 2]
    assert PromptOrder(list(range(11)), seed=3).load_state_dict(first.state_dict())  # a size change is warned


def _fake_checkpoint(run_dir: Path, step: int, complete: bool) -> Path:
    d = C.step_dir(run_dir, step)
    d.mkdir(parents=True)
    (d / "sparse_rl_checkpoint.json").write_text("{}")
    if complete:
        (d / C.STATE_FILE).write_text(json.dumps({"format_version": C.FORMAT_VERSION, "step": step}))
    return d


def test_resume_picks_the_newest_complete_checkpoint_and_prune_keeps_the_last_k(tmp_path):
    assert C.resolve_resume("auto", tmp_path) is None
    for step, complete in ((2, True), (4, True), (5, False), (6, True), (8, False)):
        _fake_checkpoint(tmp_path, step, complete)
    (tmp_path / "checkpoints" / "step_3.saving").mkdir()  # a save killed inside the learner's own staging
    assert C.resolve_resume("auto", tmp_path) == C.step_dir(tmp_path, 6)
    assert C.resolve_resume("never", tmp_path) is None
    assert C.resolve_resume(str(C.step_dir(tmp_path, 2)), tmp_path) == C.step_dir(tmp_path, 2)
    with pytest.raises(UserError, match=r"step_8 is not a complete training checkpoint \(no trainer_state.json"):
        C.resolve_resume(str(C.step_dir(tmp_path, 8)), tmp_path)
    C.prune(tmp_path, keep_last=2)
    # step 2 (beyond the last two complete), step 5 and step_3.saving (interrupted, older than step 6) are gone;
    # step 8 (interrupted, newer than the newest complete) is left for its next save to replace
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4", "step_6", "step_8"]
    assert [s for s, _ in C.complete_checkpoints(tmp_path)] == [4, 6]


def test_rng_states_round_trip():
    import numpy as np

    state = C.capture_rng()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.random(), np.random.rand(), torch.rand(())  # move every generator on
    C.restore_rng(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_stop_request_by_signal_file_and_second_ctrl_c(tmp_path, capsys):
    # whatever earlier tests of this process installed (e.g. an asyncio loop's handler) must come back
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    with StopRequest(tmp_path) as stop:
        assert stop.reason is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.reason == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a later signal does not change the first reason
        assert stop.reason == "SIGUSR1"
    assert "SIGUSR1 received: stopping at the end of the current step" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored on exit
    with StopRequest(tmp_path) as stop:
        (tmp_path / "STOP").write_text("")
        assert stop.reason == "STOP file"
        stop.clear_stop_file()
        assert stop.reason is None
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_stop_during_start_up_is_honoured_and_later_ones_do_not_kill_the_ending_process(tmp_path):
    from sparse_rl_megatron.trainer.runtime.signals import early_stops_noted

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        with early_stops_noted():
            pass
        assert {s: signal.getsignal(s) for s in before} == before  # no stop: handlers as they were
        with early_stops_noted():
            os.kill(os.getpid(), signal.SIGTERM)  # while the run sets up: noted, this process lives
            with StopRequest(tmp_path, announce=False) as stop:
                assert stop.reason == "SIGTERM"  # taken over: the run stops at its first step boundary
        os.kill(os.getpid(), signal.SIGTERM)  # a repeat (a launcher's) while the stopped run exits: ignored
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_aggregate_over_optimizer_steps():
    out = aggregate([{"loss/pg": 1.0, "train/grad_norm": 2.0, "train/step": 1, "train/skipped": 0, "train/tokens": 10},
                     {"loss/pg": 3.0, "train/grad_norm": 4.0, "train/step": 2, "train/skipped": 1, "train/tokens": 5}])
    assert out == {"loss/pg": 2.0, "train/grad_norm": 3.0, "train/grad_norm_max": 4.0, "train/step": 2,
                   "train/skipped": 1, "train/tokens": 15}
    assert aggregate([]) == {}


class CountingTask:
    """A ``Task`` whose model is a file tree (nothing loads it here); counts builds and warm starts."""

    name = "counting"
    template = "plain"
    reward = "math"
    warm_expectations = None  # unchecked

    def __init__(self):
        self.calls: list[tuple] = []

    def records(self, split, limit=None, seed=0):
        from sparse_rl_megatron.data.loader import Dataset
        from sparse_rl_megatron.data.record import MathRecord

        rows = [MathRecord(prompt=f"{split} {i}", answer=str(i), source_id=f"{split}{i}", dataset=self.name)
                for i in range(5 if split == "train" else 3)]
        return Dataset(self.name, f"task:{self.name}/{split}", rows[:limit])

    def build_model(self, out_dir, *, seed=0):
        self.calls.append(("build", Path(out_dir).name, seed))
        Path(out_dir).mkdir()  # a builder that refuses an existing directory is fine
        (Path(out_dir) / "config.json").write_text("{}")
        return Path(out_dir)

    def warm_start(self, model_dir, out_dir, *, seed=0, should_stop=None, **options):
        self.calls.append(("warm", Path(model_dir).name, Path(out_dir).name, seed, options))
        Path(out_dir).mkdir()
        (Path(out_dir) / "config.json").write_text("{}")
        return {"sft/heldout_acc": 0.25}


def test_task_model_is_built_and_warm_started_once_then_reused(tmp_path, monkeypatch):
    from sparse_rl_megatron.tasks import TASKS, Task
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.trainer.runtime.model_dirs import prepare_model
    from sparse_rl_megatron.trainer.run_plan import preflight
    from sparse_rl_megatron.utils.config_io import from_dict

    task = CountingTask()
    Task.register(CountingTask)  # a virtual subclass: the registry holds Task objects
    monkeypatch.setitem(TASKS._items, "counting", task)  # registered for this test only (the audit walks TASKS)
    cfg = from_dict(TrainConfig, {"model_path": "task:counting", "seed": 7, "run_dir": str(tmp_path),
                                  "data": {"dataset": "task:counting"}, "warm_start": {"steps": 3}})
    plan = preflight(cfg, world_size=1)
    assert (plan.template, plan.reward, plan.task is task) == ("plain", "math", True)
    assert len(plan.train_data) == 5 and list(plan.eval_data) == ["task:counting"]
    assert len(plan.eval_data["task:counting"]) == 3  # the held-out split is evaluated by default

    dirs = prepare_model(cfg, task, tmp_path)
    assert dirs.learner == dirs.engine_hf == str(tmp_path / "model" / "warm")
    # the warm start reads the built init model and writes a staging dir that is renamed into place
    assert task.calls == [("build", "init.partial", 7), ("warm", "init", "warm.partial", 7, {"steps": 3})]
    assert json.loads((tmp_path / "model" / "warm" / "warm_start.json").read_text()) == {"sft/heldout_acc": 0.25}
    task.calls.clear()
    again = prepare_model(cfg, task, tmp_path)  # a re-run or a resume reuses both
    assert again.learner == dirs.learner and task.calls == []
    assert "reusing the warm-started model" in again.notes[-1]


def test_engines_implement_the_whole_rollout_engine_protocol():
    """The run calls every ``RolloutEngine`` member without probing (no hasattr / signature checks): the built-in
    engines and SGLang's compression view define each, and their ``generate`` takes every keyword the run passes."""
    import inspect

    from sparse_rl_megatron.rollout.engine_protocol import RolloutEngine
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
    from sparse_rl_megatron.rollout.sglang_engine import CompressionView, SGLangRolloutEngine

    members = {n for n in vars(RolloutEngine) if not n.startswith("_")} | set(RolloutEngine.__annotations__)
    assert {"tokenizer", "generate", "dense_logprobs", "with_compression", "update_weights",
            "update_weights_from_payloads", "release_memory", "resume_memory", "shutdown",
            "weight_version"} <= members
    instance_attributes = {"tokenizer", "weight_version"}  # set in __init__ by the engines
    for engine in (HFRolloutEngine, SGLangRolloutEngine, CompressionView):
        missing = {m for m in members - instance_attributes if m not in vars(engine)}
        assert not missing, f"{engine.__name__} lacks {missing}"
        params = inspect.signature(engine.generate).parameters
        for keyword in ("compression", "group_ids", "budgets"):
            assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY


def test_an_engine_lacking_part_of_the_protocol_is_refused_when_built_naming_what_it_lacks():
    from sparse_rl_megatron.rollout.engine_protocol import PROTOCOL_MEMBERS, missing_members
    from sparse_rl_megatron.rollout.engine_registry import EngineBuild, EngineSpec

    assert set(PROTOCOL_MEMBERS) >= {"weight_version", "tokenizer", "generate", "shutdown"}
    stopped = []

    class Partial:  # a plugin's engine that only samples
        weight_version = 0
        tokenizer = None

        def generate(self, prompts, n, sampling, **kw):
            return []

        def shutdown(self):
            stopped.append(True)

    assert "dense_logprobs" in missing_members(Partial()) and "generate" not in missing_members(Partial())
    with pytest.raises(TypeError, match=r"rollout engine .*Partial does not implement the RolloutEngine protocol "
                                        r"\(rollout/engine_protocol.py\): it lacks dense_logprobs, release_memory"):
        EngineSpec(build=lambda build: Partial()).make(EngineBuild(model_dir="unused"))
    assert stopped == [True]  # its processes do not outlive the refusal
