"""``sparse-rl train`` with the adaptive KV budget (issue 27) on the CPU default's task, fast form: every step's
budget is the controller's answer to the previous step's logged signal, every sample's provenance carries it, and
a run stopped after step 2 and resumed samples step 3 with the same budget as the uninterrupted run. Held-out
evaluation: ``sparse`` at the configured budget at every step, ``adaptive`` at the controller's current one."""
from __future__ import annotations

import json
import subprocess

from test_train import _comparable, _env, _records, _train

from sparse_rl_megatron.compression.budget_controller import AdaptiveBudgetConfig, BudgetController

# deadband 0 and a granule of 1, so that the budget moves at (almost) every step of a 3-step run
ADAPTIVE = {"enabled": True, "target": 0.3, "min_budget": 4, "max_budget": 32, "gain": 2.0, "deadband": 0.0,
            "granule": 1}
OVERRIDES = ["rollout.adaptive_budget={" + ", ".join(f"{k}: {str(v).lower()}" for k, v in ADAPTIVE.items()) + "}",
             "checkpoint.save_every=1", "eval.every=0", "eval.modes=[dense,sparse,adaptive]", "log.plot=false"]


def test_adaptive_budget_follows_the_signal_and_resumes(tmp_path, shared_data):
    env = _env(shared_data)
    whole, split = tmp_path / "whole", tmp_path / "split"
    procs = [subprocess.Popen(_train(d, f"steps={s}", *OVERRIDES), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for d, s in ((whole, 3), (split, 2))]
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
    resumed = subprocess.run(_train(split, "steps=3", *OVERRIDES), env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {split / 'checkpoints' / 'step_2'}" in resumed.stdout

    steps = [r for r in _records(whole) if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # step 1 samples with compression.budget (8 in the fast form); each next budget is the controller's update
    # on the signal logged at the step before (replayed here from the metrics alone)
    replay = BudgetController(AdaptiveBudgetConfig(**ADAPTIVE), 8)
    for r in steps:
        assert r["rollout/budget"] == replay.budget and r["rollout/budget_target"] == 0.3
        assert r["rollout/budget_signal"] == r["sparse/contaminated_frac"]
        assert r["rollout/budget_sampled_mean"] == r["rollout/budget"]  # the samples' provenance: sampled with it
        replay.update(r["rollout/budget_signal"])
    budgets = [r["rollout/budget"] for r in steps]
    assert len(set(budgets)) > 1, budgets  # it adapted (0 deadband: it moves unless the signal is 0.3 exactly)
    # evaluations before step 1 and after step 3: sparse at the configured budget, adaptive at the controller's
    first, last = _records(whole)[0], steps[-1]
    assert first["step"] == 0 and first["eval/sparse/budget"] == first["eval/adaptive/budget"] == 8
    assert last["eval/sparse/budget"] == 8 and last["eval/adaptive/budget"] == replay.budget != 8
    state = json.loads((whole / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert state["budget_controller"]["budget"] == replay.budget
    # the resumed run's steps are the uninterrupted run's, budgets and signals included (bit-exact on CPU)
    split_steps = [r for r in _records(split) if r["step"] >= 1]
    assert [r["step"] for r in split_steps] == [1, 2, 3]
    for w, s in zip(steps, split_steps):  # (the first half evaluated at its last step, 2: held-out metrics aside)
        same = lambda r: {k: v for k, v in _comparable(r).items() if not k.startswith("eval/")}  # noqa: E731
        assert same(w) == same(s), f"step {w['step']} differs"
