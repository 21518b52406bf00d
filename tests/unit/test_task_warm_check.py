"""The warm-start check (tasks/warm_check.py) and the trainer's rule on a miss (trainer/runtime/model_dirs.py):
retry with the next warm-start seed, record every attempt's verdict, stop in one line when all missed."""
from __future__ import annotations

import json
import shutil
import math

import pytest

from sparse_rl_megatron.tasks.modchain import ModChainModel, ModChainSpec, ModChainTask
from sparse_rl_megatron.tasks.modchain_teacher import EarlyStopTeacher
from sparse_rl_megatron.tasks.warm_check import WarmStartExpectations, _respond, chain_measures, check_warm_start

TINY = ModChainSpec(steps=6, heldout_size=40, heldout_variants=1, train_variants=2, teacher=EarlyStopTeacher(stop_step=4),
                    model=ModChainModel(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64))
LOOSE = WarmStartExpectations(max_loss=3.0, min_taught_accuracy=0.0, min_taught_full_chains=0.0, min_boxes_right=0.0,
                              problems=12)
"""Only the loss decides: measured on this model, 1 supervised step leaves ~6.1 and 40 steps ~1.75 (seeds 0-2)."""
QUICK = {"lr": 1e-2, "batch_size": 8, "log_every": 0}


def _records():
    task = ModChainTask(TINY, name="tiny_check")
    records = task.records("heldout", limit=12)
    assert {r.extra["subset"] for r in records} == {"odd_x_stop", "rest"}
    return task, records


def test_chain_measures_count_taught_records_full_chains_and_boxes_exactly():
    _, records = _records()
    solutions = [r.extra["solution"] for r in records]
    right = [True] * len(records)
    m = chain_measures(records, solutions, right, loss_last=0.01)
    taught = sum(r.extra["subset"] == "rest" for r in records)
    assert m == {"loss_last": 0.01, "problems": 12.0, "heldout_accuracy": 1.0, "taught_problems": float(taught),
                 "taught_accuracy": 1.0, "taught_full_chains": 1.0, "full_chains": 12.0, "boxes_right": 1.0}
    # the lottery: every chain right, the answer wrong on the first three records
    wrong_box = [s.rsplit(" ", 1)[0] + " \\boxed{99}" if i < 3 else s for i, s in enumerate(solutions)]
    m = chain_measures(records, wrong_box, [i >= 3 for i in range(12)], loss_last=0.01)
    assert m["full_chains"] == 12.0 and m["boxes_right"] == 9 / 12
    # a chain stopped early is not a full chain; a taught record answered wrong lowers the taught accuracy
    first_taught = next(i for i, r in enumerate(records) if r.extra["subset"] == "rest")
    stopped = list(solutions)
    stopped[first_taught] = " ".join(solutions[first_taught].split()[:4]) + " \\boxed{1}"
    m = chain_measures(records, stopped, [i != first_taught for i in range(12)], loss_last=0.01)
    assert m["taught_accuracy"] == m["taught_full_chains"] == (taught - 1) / taught
    assert m["full_chains"] == 11.0 and m["boxes_right"] == 1.0
    # no full chain at all: the share of right boxes is undefined, and misses its bound
    m = chain_measures(records, ["sZero"] * 12, [False] * 12, loss_last=0.01)
    assert math.isnan(m["boxes_right"]) and m["full_chains"] == 0.0
    with pytest.raises(ValueError, match="12 records, 11 responses"):
        chain_measures(records, solutions[:11], right, loss_last=0.01)


def test_expectations_name_each_miss_and_refuse_bad_bounds():
    bounds = WarmStartExpectations(max_loss=0.02, min_taught_accuracy=0.9, min_taught_full_chains=0.9,
                                   min_boxes_right=0.95)
    good = {"loss_last": 0.005, "taught_accuracy": 1.0, "taught_full_chains": 1.0, "boxes_right": 0.96}
    assert bounds.judge(good) == []
    assert bounds.judge({**good, "loss_last": 0.03, "boxes_right": 0.43}) == [
        "supervised loss 0.0300 > 0.02", "right answers on the full chains 0.430 < 0.95"]
    assert bounds.judge({**good, "taught_full_chains": float("nan")}) == [
        "full chains on the taught records nan < 0.9"]
    with pytest.raises(ValueError, match="min_boxes_right must be in \\[0, 1\\], got 1.5"):
        WarmStartExpectations(max_loss=0.02, min_taught_accuracy=0.9, min_taught_full_chains=0.9, min_boxes_right=1.5)
    with pytest.raises(ValueError, match="problems must be >= 1"):
        WarmStartExpectations(max_loss=0.02, min_taught_accuracy=0, min_taught_full_chains=0, min_boxes_right=0,
                              problems=0)


def test_an_untrained_model_misses_the_embedded_defaults_expectations(tmp_path):
    from sparse_rl_megatron.tasks import get_task

    task, _ = _records()
    init = task.build_model(tmp_path / "init", seed=0)
    expected = get_task("modchain31_wordbox_weak").warm_expectations  # the embedded default's
    check = check_warm_start(task, init, WarmStartExpectations(**{**vars(expected), "problems": 12}), loss_last=6.1)
    assert not check.passed and check.measured["problems"] == 12.0
    assert check.measured["taught_full_chains"] == 0.0 and math.isnan(check.measured["boxes_right"])
    assert check.missed[0] == "supervised loss 6.1000 > 0.02" and len(check.missed) == 5
    assert check.missed[-1] == "sampled accuracy on the taught records 0.000 < 0.65"
    assert check.summary().startswith("missed: supervised loss 6.1000 > 0.02; ")
    assert json.loads(json.dumps(check.to_json(), allow_nan=True))["passed"] is False


def test_the_check_scores_the_compressed_cache_the_run_samples_with(tmp_path):
    from sparse_rl_megatron.compression import CompressionConfig

    task, _ = _records()
    init = task.build_model(tmp_path / "init", seed=0)
    sparse_only = WarmStartExpectations(max_loss=10.0, min_taught_accuracy=0.0, min_taught_full_chains=0.0,
                                        min_boxes_right=0.0, min_sparse_taught_accuracy=0.5, problems=12)
    rkv = CompressionConfig(method="rkv", budget=4, window=2, buffer=2, scope="response")
    check = check_warm_start(task, init, sparse_only, loss_last=6.1, compression=rkv)
    assert check.missed == (f"accuracy on the taught records with the compressed cache "
                            f"{check.measured['sparse_taught_accuracy']:.3f} < 0.5",)
    assert "with the compressed cache" in check.summary()
    dense_run = check_warm_start(task, init, sparse_only, loss_last=6.1, compression=CompressionConfig())
    assert dense_run.passed and "sparse_taught_accuracy" not in dense_run.measured  # a dense run has no such cache


def test_the_sampled_accuracy_is_drawn_as_the_rollouts_draw_them(tmp_path):
    """At temperature 0 the sampled measure is the greedy one of the same cache (dense, or the run's compressed
    cache): the temperature and the cache reach the sampler; at temperature 1 it is seeded (the same value again)."""
    from sparse_rl_megatron.compression import CompressionConfig

    task, _ = _records()
    init = task.build_model(tmp_path / "init", seed=0)
    loss = task.warm_start(init, tmp_path / "warm", seed=0, **{**QUICK, "steps": 500})["sft/loss_last"]
    bounds = WarmStartExpectations(max_loss=10.0, min_taught_accuracy=0.0, min_taught_full_chains=0.0,
                                   min_boxes_right=0.0, min_sparse_taught_accuracy=0.0,
                                   min_sampled_taught_accuracy=0.9, samples_per_problem=2, problems=12)
    greedy = check_warm_start(task, tmp_path / "warm", bounds, loss, temperature=0.0)
    # measured on this model (500 steps, seed 0): 2 of the 9 taught records right greedily, densely
    assert greedy.measured["sampled_taught_accuracy"] == greedy.measured["taught_accuracy"] > 0
    rkv = CompressionConfig(method="rkv", budget=4, window=2, buffer=2, scope="response")
    greedy_rkv = check_warm_start(task, tmp_path / "warm", bounds, loss, compression=rkv, temperature=0.0)
    assert greedy_rkv.measured["sampled_taught_accuracy"] == greedy_rkv.measured["sparse_taught_accuracy"]
    sampled = check_warm_start(task, tmp_path / "warm", bounds, loss, temperature=1.0)
    value = sampled.measured["sampled_taught_accuracy"]
    assert value == check_warm_start(task, tmp_path / "warm", bounds, loss, temperature=1.0).measured[
        "sampled_taught_accuracy"]
    # sampled, not greedy: on this half-trained model no taught record's two samples are both its greedy response
    # (a 67-token response at temperature 1; the accuracies alone can coincide, as 1/9 and 1/9 did on AVX2)
    taught = [r for r in task.records("heldout", limit=12) if r.extra["subset"] == "rest"]
    greedy_texts, _ = _respond(task, tmp_path / "warm", taught, None)
    sampled_texts, _ = _respond(task, tmp_path / "warm", taught, None, 2, 1.0, 0)
    assert sampled_texts == _respond(task, tmp_path / "warm", taught, None, 2, 1.0, 0)[0]  # seeded
    assert all(sampled_texts[2 * i] != g or sampled_texts[2 * i + 1] != g for i, g in enumerate(greedy_texts))
    assert value < 0.9 and sampled.missed == (f"sampled accuracy on the taught records {value:.3f} < 0.9",)
    assert f", sampled {value:.3f}" in sampled.summary()
    without = WarmStartExpectations(**{**vars(bounds), "min_sampled_taught_accuracy": None})
    assert "sampled_taught_accuracy" not in check_warm_start(task, tmp_path / "warm", without, loss).measured
    with pytest.raises(ValueError, match="samples_per_problem must be >= 1, got 0"):
        WarmStartExpectations(**{**vars(bounds), "samples_per_problem": 0})


class LotteryTask(ModChainTask):
    """The tiny task with a warm start that misses on the run's own seed (one supervised step) and converges on any
    other (40 steps): the lottery of a warm start, made deterministic, with the real check."""

    def __init__(self, miss_seeds: set[int]):
        super().__init__(TINY, name="tiny_lottery")
        self.warm_expectations = LOOSE
        self.miss_seeds, self.seeds = miss_seeds, []

    def warm_start(self, model_dir, out_dir, *, seed=0, should_stop=None, **options):
        self.seeds.append(seed)
        steps = 1 if seed in self.miss_seeds else 40
        return super().warm_start(model_dir, out_dir, seed=seed, should_stop=should_stop,
                                  **{**options, **QUICK, "steps": steps})


def _prepare(tmp_path, task, **warm_check):
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.trainer.runtime.model_dirs import prepare_model
    from sparse_rl_megatron.utils.config_io import from_dict

    cfg = from_dict(TrainConfig, {"model_path": "task:tiny_lottery", "seed": 5, "run_dir": str(tmp_path),
                                  "warm_check": warm_check})
    return prepare_model(cfg, task, tmp_path)


def test_a_missed_warm_start_is_retried_with_the_next_seed_and_recorded(tmp_path, capsys):
    task = LotteryTask(miss_seeds={5})
    dirs = _prepare(tmp_path, task)
    model = tmp_path / "model"
    assert task.seeds == [5, 1005] and dirs.learner == str(model / "warm")
    said = capsys.readouterr().out
    assert "warm start attempt 1 of 3, warm-start seed 5 missed: supervised loss 6." in said
    assert "warm.missed-1" in said and (model / "warm.missed-1" / "config.json").is_file()
    assert "attempt 2 of 3, warm-start seed 1005); check passed" in dirs.notes[-1]
    verdicts = json.loads((model / "warm_check.json").read_text())
    assert verdicts["verdict"] == "passed" and [a["seed"] for a in verdicts["attempts"]] == [5, 1005]
    assert [a["passed"] for a in verdicts["attempts"]] == [False, True]
    assert verdicts["attempts"][0]["missed"][0].startswith("supervised loss 6.")
    warm = json.loads((model / "warm" / "warm_start.json").read_text())
    assert warm["sft/seed"] == 1005 and warm["check/passed"] == 1.0 and warm["sft/steps"] == 40
    assert warm["check/loss_last"] == warm["sft/loss_last"] < LOOSE.max_loss
    again = _prepare(tmp_path, task)  # a re-run or a resume reuses the checked model, saying how it passed
    assert task.seeds == [5, 1005]
    assert again.notes[-1].endswith("(check passed at attempt 2, warm-start seed 1005)"), again.notes[-1]
    other = _prepare(tmp_path, task, attempts=4)  # other settings: said, not silently reused
    assert "this run asks" in other.notes[-1] and "'attempts': 4" in other.notes[-1] and task.seeds == [5, 1005]


def test_a_warm_start_that_misses_on_every_attempt_stops_the_run_in_one_line(tmp_path):
    from sparse_rl_megatron.utils.errors import RunFailed

    task = LotteryTask(miss_seeds={5, 1005})
    with pytest.raises(RunFailed) as err:
        _prepare(tmp_path, task, attempts=2)
    message = str(err.value)
    assert "\n" not in message and "missed its check on all 2 attempts (last: supervised loss 6." in message
    assert "warm_start.steps=" in message and "warm_check.enabled=false" in message
    assert task.seeds == [5, 1005] and not (tmp_path / "model" / "warm").exists()
    verdicts = json.loads((tmp_path / "model" / "warm_check.json").read_text())  # valid JSON: no NaN
    assert verdicts["verdict"] == "missed" and len(verdicts["attempts"]) == 2
    assert verdicts["attempts"][0]["measured"]["boxes_right"] is None  # no full chain: a share over nothing
    with pytest.raises(RunFailed, match="on all 2 attempts already, with these settings"):
        _prepare(tmp_path, task, attempts=2)  # the same seeds would miss the same way: said at once
    assert task.seeds == [5, 1005]


def test_a_run_stopped_between_attempts_goes_on_at_the_next_one(tmp_path, capsys):
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.trainer.runtime.model_dirs import prepare_model
    from sparse_rl_megatron.utils.config_io import from_dict
    from sparse_rl_megatron.utils.errors import StoppedEarly

    task = LotteryTask(miss_seeds={5})
    cfg = from_dict(TrainConfig, {"model_path": "task:tiny_lottery", "seed": 5, "run_dir": str(tmp_path)})
    with pytest.raises(StoppedEarly):  # stopped during attempt 2, after attempt 1 missed
        prepare_model(cfg, task, tmp_path, should_stop=lambda: "SIGTERM" if len(task.seeds) == 2 else None)
    model = tmp_path / "model"
    assert task.seeds == [5, 1005] and (model / "warm.missed-1").is_dir() and not (model / "warm").exists()
    assert json.loads((model / "warm_check.json").read_text())["verdict"] == "retrying"
    capsys.readouterr()
    dirs = _prepare(tmp_path, task)
    assert task.seeds == [5, 1005, 1005]  # attempt 1 (seed 5) is not built again
    assert dirs.notes[0] == ("attempt 1 of an earlier run with these settings missed the check (kept as "
                             "warm.missed-*): going on at attempt 2")
    assert "attempt 2 of 3, warm-start seed 1005); check passed" in dirs.notes[-1]
    verdicts = json.loads((model / "warm_check.json").read_text())
    assert verdicts["verdict"] == "passed" and [a["seed"] for a in verdicts["attempts"]] == [5, 1005]
    # other settings, or the missed model gone: every attempt again from the first
    other = tmp_path / "other"
    task = LotteryTask(miss_seeds={5})
    with pytest.raises(StoppedEarly):
        prepare_model(cfg, task, other, should_stop=lambda: "SIGTERM" if len(task.seeds) == 2 else None)
    shutil.rmtree(other / "model" / "warm.missed-1")
    prepare_model(cfg, task, other)
    assert task.seeds == [5, 1005, 5, 1005]


def test_without_the_check_the_first_warm_start_is_used_as_it_is(tmp_path):
    task = LotteryTask(miss_seeds={5})
    dirs = _prepare(tmp_path, task, enabled=False)
    assert task.seeds == [5] and dirs.learner == str(tmp_path / "model" / "warm")
    assert not (tmp_path / "model" / "warm_check.json").exists()
    assert json.loads((tmp_path / "model" / "warm" / "warm_start.json").read_text())["sft/steps"] == 1


def test_the_retry_seed_rule_and_bad_attempts():
    from sparse_rl_megatron.trainer.config import WarmCheckConfig

    assert [WarmCheckConfig().seed(7, k) for k in range(3)] == [7, 1007, 2007]
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        WarmCheckConfig(attempts=0)
