"""``sparse-rl train`` under ``launch/torchrun.sh`` (2 gloo ranks on CPU) when its processes are signalled:

- SIGTERM to every process of the run (what Slurm's scancel does): the ranks save at the end of their step, the
  launcher exits 0 with one line (torchrun alone raised SignalException and exited 1); the re-run resumes;
- SIGKILL of the launcher's torchrun: its ranks (each in a session of its own) end with it, and what they
  started (the reward's verifier workers, multiprocessing's helpers) with them; the run directory is free;
- SIGKILL of rank 1's checkpoint writer processes mid-save (the OOM killer): every rank fails the save, one
  line (rank 1's) names rank 1 and the writer (megatron's saver waited for it forever), the previous checkpoint intact;
  the re-run resumes;
- SIGKILL of one rank: the whole run ends within torchrun's shutdown timeout, exit status non-zero, leaving no
  rank, verifier worker or helper process. (The SGLang engine's processes when the process holding the engine is
  killed: tests/sglang/test_engine_faults.py, one process, the same kill; here, the killed scheduler's run takes
  down rank 1 and its engine through torchrun, and nothing of either engine is left.)

Every process of a run is listed (``psutil``, the launcher's descendants) just before the fault, and each must be
gone within a generous bound afterwards; the faults are timed by the ranks' heartbeat files (explicit signals)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from test_train import RECIPE, ROOT, SMALL, _env, free_port

BOUND_S = 240.0
"""Generous bound on every wait: set-up on a loaded 2-core machine, torchrun's 30 s shutdown timeout, exits."""
TASK = ["plugins=[train_task_plugin]", "model_path=task:tiny_sums", "data.dataset=task:tiny_sums",
        "eval.datasets=[]", "learner.tensor_parallel_size=2"]
"""The wiring task (math reward: a verifier process pool on rank 0), its learner at TP 2 over the 2 ranks."""
SGLANG = [*TASK, "rollout.engine=sglang", "rollout.sglang.max_total_tokens=4096"]
"""The same with SGLang engines in process: one per rank (one per GPU; each with a scheduler and a detokenizer
as child processes)."""


def _launch(run_dir: Path, log: Path, shared_data: Path, *overrides: str, env: dict | None = None
            ) -> subprocess.Popen:
    env = {**_env(shared_data), **(env or {}), "NNODES": "1", "NPROC_PER_NODE": "2", "RDZV_ID": f"faults-{os.getpid()}",
           "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "PYTHON": sys.executable, "SKIP_PREFLIGHT": "1"}
    args = ["--config", RECIPE, f"run_dir={run_dir}", *SMALL, "checkpoint.save_every=1", *overrides]
    with open(log, "a") as out:
        return subprocess.Popen(["bash", str(ROOT / "launch" / "torchrun.sh"), *args], env=env, cwd=run_dir.parent,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_phase(run_dir: Path, launcher: subprocess.Popen, log: Path, step: int, phase: str) -> None:
    """Until rank 0's heartbeat (``<date> <time> rank 0 step <k> <phase>``) names ``phase`` of ``step`` or a later
    step."""
    beat = run_dir / "heartbeat" / "rank0"
    deadline = time.monotonic() + BOUND_S
    while True:
        words = beat.read_text().split() if beat.is_file() else []
        if len(words) == 7 and (int(words[5]) > step or (int(words[5]) == step and words[6] == phase)):
            return
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)


def _tree(launcher: subprocess.Popen) -> dict[str, list[psutil.Process]]:
    """The run's processes by role: torchrun, the ranks (by RANK), and everything the ranks started."""
    everyone = psutil.Process(launcher.pid).children(recursive=True)
    torchrun = [p for p in everyone if "torch.distributed.run" in " ".join(p.cmdline())]
    assert len(torchrun) == 1, [p.cmdline() for p in everyone]
    ranks = {}
    for p in torchrun[0].children():
        ranks[int(p.environ()["RANK"])] = p
    assert sorted(ranks) == [0, 1], [p.cmdline() for p in everyone]
    helpers = [p for p in everyone if p not in torchrun and p not in ranks.values()]
    return {"torchrun": torchrun, "rank0": [ranks[0]], "rank1": [ranks[1]], "helpers": helpers}


def _all_gone(procs: list[psutil.Process], log: Path) -> None:
    _, alive = psutil.wait_procs(procs, timeout=BOUND_S)
    left = [(p.pid, " ".join(p.cmdline())[:120]) for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left behind: {left}\n{log.read_text()[-3000:]}"


def _cleanup(launcher: subprocess.Popen, procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait()


def test_sigterm_to_every_process_stops_clean_then_a_killed_launcher_takes_its_ranks_along(tmp_path, shared_data):
    from sparse_rl_megatron.trainer.runtime.run_dir import RunDirLock

    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    run_dir.mkdir()
    launcher = _launch(run_dir, log, shared_data, *TASK, "steps=4")
    procs: list[psutil.Process] = []
    try:
        _wait_for_phase(run_dir, launcher, log, 1, "train")
        procs = [psutil.Process(launcher.pid)] + sum(_tree(launcher).values(), [])
        for p in procs:  # scancel: SIGTERM to every process of the job
            p.send_signal(signal.SIGTERM)
        assert launcher.wait(BOUND_S) == 0, log.read_text()[-4000:]
        text = log.read_text()
        assert "SignalException" not in text and "Traceback" not in text, text[-4000:]
        stopped = [x for x in text.splitlines() if x.startswith("stopped at step")]
        assert len(stopped) == 1 and "by SIGTERM; checkpoint" in stopped[0], text[-3000:]
        k = int(stopped[0].split()[3])
        launched = [x for x in text.splitlines() if "stopped on request (SIGTERM): every rank saved and exited 0" in x]
        assert len(launched) == 1, text[-3000:]
        assert (run_dir / "checkpoints" / f"step_{k}" / "trainer_state.json").is_file()
        _all_gone(procs[1:], log)

        # the re-run resumes; then its torchrun is killed (kill -9): the ranks end with it (orphans would train on
        # through all these steps, far past the bound)
        launcher = _launch(run_dir, log, shared_data, *TASK, "steps=1000")
        _wait_for_phase(run_dir, launcher, log, k + 1, "rollout")
        assert f"resuming from {run_dir / 'checkpoints' / f'step_{k}'}" in log.read_text()
        tree = _tree(launcher)
        procs = sum(tree.values(), [])
        assert tree["helpers"], "rank 0's verifier pool should be running"
        tree["torchrun"][0].kill()
        _all_gone(procs, log)
        with RunDirLock(run_dir):  # free: no rank holds it any more
            pass
        assert (run_dir / "checkpoints" / f"step_{k}" / "trainer_state.json").is_file()
    finally:
        _cleanup(launcher, procs)


def test_kill_9_of_one_rank_ends_the_whole_run_leaving_no_process(tmp_path, shared_data):
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    run_dir.mkdir()
    launcher = _launch(run_dir, log, shared_data, *TASK, "steps=20")
    procs: list[psutil.Process] = []
    try:
        _wait_for_phase(run_dir, launcher, log, 1, "rollout")
        tree = _tree(launcher)
        procs = sum(tree.values(), [])
        tree["rank1"][0].kill()
        code = launcher.wait(BOUND_S)
        assert code != 0, log.read_text()[-3000:]
        _all_gone(procs, log)
    finally:
        _cleanup(launcher, procs)


def test_a_killed_engine_scheduler_fails_every_rank_in_one_line_naming_it_and_the_step(tmp_path, shared_data):
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    run_dir.mkdir()
    # long responses (the random model rarely ends one), so the rollout of step 2 lasts seconds: the kill lands in
    # it (or, on a loaded machine, in the step's next engine call: the error allows train and sync)
    launcher = _launch(run_dir, log, shared_data, *SGLANG, "steps=20", "rollout.sampling.max_new_tokens=500")
    procs: list[psutil.Process] = []
    try:
        _wait_for_phase(run_dir, launcher, log, 2, "rollout")
        tree = _tree(launcher)
        procs = sum(tree.values(), [])
        schedulers = [p for p in tree["helpers"] if p.name().startswith("sglang::scheduler")]  # SGLang's titles
        assert sorted(p.ppid() for p in schedulers) == sorted(p.pid for p in tree["rank0"] + tree["rank1"])
        detokenizers = [p for p in tree["helpers"] if p.name().startswith("sglang::detokenizer")]
        assert sorted(p.ppid() for p in detokenizers) == sorted(p.pid for p in tree["rank0"] + tree["rank1"])
        found = [p for p in schedulers if p.ppid() == tree["rank0"][0].pid]
        scheduler = found[0]
        scheduler.kill()
        assert launcher.wait(BOUND_S) != 0
        _all_gone(procs, log)
    finally:
        _cleanup(launcher, procs)
    text = log.read_text()
    errors = [x for x in text.splitlines() if "sparse-rl train: error:" in x]
    # the kill lands in the rollout of step 2 (each engine decodes its 2 responses of up to 500 tokens for
    # seconds); the watch names the phase of its next engine call, on a loaded machine possibly after the rollout,
    # or (the process listing before the kill slowed down) the next step's: the step named and the last
    # checkpoint named must agree
    found_error = len(errors) == 1 and re.search(
        rf"sparse-rl train: error: the SGLang engine's process scheduler_0 \(pid {scheduler.pid}\) was killed by "
        rf"signal SIGKILL; in the (rollout|train|sync) of step (\d+) on rank 0; last complete checkpoint: "
        rf"{re.escape(str(run_dir / 'checkpoints'))}/step_(\d+); rerun the same command to resume "
        r"\(checkpoint.resume: auto\)$",
        errors[0])
    assert found_error, text[-4000:]
    step, saved = int(found_error.group(2)), int(found_error.group(3))
    assert step >= 2 and saved == step - 1, errors[0]
    rank_tracebacks = [x for x in text.splitlines() if x.startswith(("[rank0]: Traceback", "[rank1]: Traceback"))]
    assert not rank_tracebacks, text[-6000:]
    assert (run_dir / "checkpoints" / f"step_{saved}" / "trainer_state.json").is_file()


def test_killed_checkpoint_writers_on_one_rank_fail_the_save_on_every_rank_and_the_rerun_resumes(tmp_path,
                                                                                                  shared_data):
    from fault_plugin import KILL_WRITER_AT_SAVE, KILL_WRITER_RANK

    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    run_dir.mkdir()
    plugins = "plugins=[train_task_plugin,fault_plugin]"
    launcher = _launch(run_dir, log, shared_data, *TASK, plugins, "steps=3",
                       env={KILL_WRITER_AT_SAVE: "2", KILL_WRITER_RANK: "1"})
    try:
        assert launcher.wait(BOUND_S) != 0, log.read_text()[-4000:]
        text = log.read_text()
        step1, step2 = run_dir / "checkpoints" / "step_1", run_dir / "checkpoints" / "step_2"
        errors = [x for x in text.splitlines() if "sparse-rl train: error: " in x]
        assert len(errors) == 1 and re.search(  # printed once, by rank 1
            rf"sparse-rl train: error: saving checkpoint {re.escape(str(step2))} failed on rank 1: checkpoint writer "
            r"process \d+ died \(signal SIGKILL\) before it wrote its files; nothing of it was kept; in the save of "
            r"step 2 on rank 1; ", errors[0]), text[-4000:]
        assert not [x for x in text.splitlines() if x.startswith(("[rank0]: Traceback", "[rank1]: Traceback"))], \
            text[-6000:]
        assert sorted(p.name for p in step1.parent.iterdir()) == ["step_1"]
    finally:
        _cleanup(launcher, [])
    launcher = _launch(run_dir, log, shared_data, *TASK, plugins, "steps=3")
    try:
        assert launcher.wait(BOUND_S) == 0, log.read_text()[-4000:]
        assert f"resuming from {step1}" in log.read_text()
        assert (run_dir / "checkpoints" / "step_3" / "trainer_state.json").is_file()
    finally:
        _cleanup(launcher, [])
