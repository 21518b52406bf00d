"""The trainer's state in a checkpoint (trainer/checkpointing/state.py): captured from a run, written as JSON, read
back and restored into a run, in one typed home."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from sparse_rl_megatron.compression.budget_controller import AdaptiveBudgetConfig, BudgetController
from sparse_rl_megatron.trainer.checkpointing.state import FORMAT_VERSION, TrainerState
from sparse_rl_megatron.trainer.partial_rollouts import PartialRollouts
from sparse_rl_megatron.trainer.runtime.prompts import PromptOrder


@dataclass
class _Learner:
    steps: int


@dataclass
class _Run:
    """The parts of ``trainer.run.Run`` a trainer state is captured from and restored into (``CheckpointedRun``)."""

    step: int
    learner: _Learner
    prompts: PromptOrder | None
    budget_controller: BudgetController | None
    partial: PartialRollouts | None = None


def _budget() -> BudgetController:
    return BudgetController(AdaptiveBudgetConfig(enabled=True, min_budget=4, max_budget=32), 8)


def test_capture_write_read_restore_round_trip():
    prompts = PromptOrder(list(range(10)), seed=3)
    prompts.take(4)
    budget = _budget()
    budget.update_from_metrics({"sparse/contaminated_frac": 0.9})
    run = _Run(step=5, learner=_Learner(steps=10), prompts=prompts, budget_controller=budget)
    state = TrainerState.capture(run, step=5, seed=3)
    assert (state.step, state.weight_version, state.learner_steps, state.seed) == (5, 5, 10, 3)
    assert state.format_version == FORMAT_VERSION and state.budget_controller == budget.state_dict()
    back = TrainerState.from_json(json.loads(json.dumps(state.to_json())))
    assert back == state
    fresh = _Run(step=0, learner=_Learner(steps=0), prompts=PromptOrder(list(range(10)), seed=3), budget_controller=_budget())
    assert back.restore(fresh, world_size=1) == []
    assert fresh.step == 5 and fresh.prompts.take(4) == prompts.take(4) and fresh.budget_controller.budget == budget.budget


def test_restore_warns_what_it_cannot_restore_and_ranks_without_prompts_skip_them():
    state = TrainerState(step=2, weight_version=2, learner_steps=4, seed=0, data=PromptOrder([1, 2], seed=0).state_dict(),
                         world_size=2)
    run = _Run(step=0, learner=_Learner(0), prompts=PromptOrder([1, 2, 3], seed=0), budget_controller=_budget())
    warnings = state.restore(run, world_size=1)
    assert run.step == 2 and len(warnings) == 3
    assert warnings[0] == "the checkpoint has no adaptive budget state: the budget restarts at 8"
    assert "the data set now has 3 problems, the checkpoint's had 2" in warnings[1]
    assert warnings[2] == "the checkpoint was written by 2 ranks, this run has 1: RNG states are not all restored"
    other_rank = _Run(step=0, learner=_Learner(0), prompts=None, budget_controller=None)
    assert state.restore(other_rank, world_size=1) == [] and other_rank.step == 2


def test_the_partial_rollouts_in_flight_are_kept_or_their_loss_is_said():
    """With ``rollout.partial`` the samples in flight are captured and restored; switched off on resume, dropped with
    a warning; a checkpoint saved with it off restores none into a run with it on, and says so."""
    import torch

    from sparse_rl_megatron.rollout.config import PartialRolloutConfig
    from sparse_rl_megatron.rollout.sample import Sample

    partial = PartialRollouts(PartialRolloutConfig(enabled=True), prompts_per_step=1, n=1, next_group=7)
    partial.in_flight = [Sample(prompt_ids=[1, 2], response_ids=[3, 4], sampler_logprobs=torch.tensor([-0.5, -0.25]),
                                group_id=6, weight_version=3, token_versions=[2, 3])]
    run = _Run(step=4, learner=_Learner(8), prompts=PromptOrder([1, 2], seed=0), budget_controller=None,
               partial=partial)
    state = TrainerState.from_json(json.loads(json.dumps(TrainerState.capture(run, step=4, seed=0).to_json())))
    fresh = PartialRollouts(PartialRolloutConfig(enabled=True), prompts_per_step=1, n=1)
    assert state.restore(_Run(0, _Learner(0), PromptOrder([1, 2], seed=0), None, fresh), world_size=1) == []
    assert fresh.next_group == 7 and [s.to_dict() for s in fresh.in_flight] == [s.to_dict() for s in partial.in_flight]
    off = _Run(0, _Learner(0), PromptOrder([1, 2], seed=0), None, None)
    assert state.restore(off, world_size=1) == ["rollout.partial is off now: the checkpoint's 1 samples in flight are "
                                                 "dropped"]
    without = TrainerState(step=1, weight_version=1, learner_steps=2, seed=0, data=PromptOrder([1, 2], seed=0).state_dict())
    on = _Run(0, _Learner(0), PromptOrder([1, 2], seed=0), None, PartialRollouts(PartialRolloutConfig(enabled=True), 1, 1))
    assert without.restore(on, world_size=1) == ["the checkpoint was saved with rollout.partial off: no samples in flight "
                                                 "to continue"]


def test_a_state_file_of_another_shape_is_named():
    good = TrainerState(step=1, weight_version=1, learner_steps=2, seed=0, data={}).to_json()
    with pytest.raises(ValueError, match="missing data, seed; unknown colour"):
        TrainerState.from_json({**{k: v for k, v in good.items() if k not in ("data", "seed")}, "colour": 1})


def test_the_two_counts_a_state_keeps_beside_its_step_are_checked_on_resume(tmp_path):
    """``weight_version`` must be the step (else the state is refused when read), and ``learner_steps`` the count the
    learner's own files restore (else the checkpoint does not load: its parts are of different saves)."""
    from types import SimpleNamespace

    from sparse_rl_megatron.trainer.checkpointing.resume import Choice, load
    from sparse_rl_megatron.utils.errors import RunFailed

    good = TrainerState(step=3, weight_version=3, learner_steps=6, seed=0, data={}).to_json()
    assert TrainerState.from_json(good).weight_version == 3
    with pytest.raises(ValueError, match=r"^weight_version 2 is not its step 3 "):
        TrainerState.from_json({**good, "weight_version": 2})

    class _Loading:
        steps = 0

        def load(self, path):
            self.steps = 5   # the learner's files: one optimizer step fewer than the trainer state says

    ckpt = tmp_path / "step_3"
    run = SimpleNamespace(cfg=SimpleNamespace(checkpoint=SimpleNamespace(resume=str(ckpt))), run_dir=tmp_path,
                          learner=_Loading(), say=lambda text: None)
    with pytest.raises(RunFailed, match=r"step_3 does not load into this run's model: its learner files record 5 "
                                        r"optimizer steps, its trainer state 6: parts of different saves$"):
        load(run, Choice(ckpt, TrainerState.from_json(good)))
