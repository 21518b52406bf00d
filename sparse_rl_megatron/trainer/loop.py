"""The Sparse-RL training loop (``sparse-rl train``), top to bottom.

Per rollout step k (every rank runs it; the engines live on the ranks of ``rollout/layout.py``; the learner and
the engines take turns on the device, ``runtime/device_turns.py``):
  1. rollout of n samples per prompt on the (compressed-KV) engines, each on its share of the groups, and reward
     where the samples are (the learner asleep); dense recompute of pi_old (+ reference log-probs when KL is on),
     rejection + reweighting + advantages on the whole batch (the engines' memory released);
  2. optimizer steps on ``global_batch_size`` slices (none when correction rejected everything);
  3. a checkpoint every ``save_every`` steps, at the end, and when a stop is requested (SIGTERM / SIGUSR1 / Ctrl-C /
     STOP file: save, then exit 0 at the end of the step);
  4. weight sync to every engine as version k, verified by the log-prob probe on each;
  5. held-out evaluation dense and sparse; metrics.
Set-up, resume and the services called here live in ``run.py``; the data half of a step in ``step.py``.
"""
from __future__ import annotations

import time

from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.observability.metrics_writer import read_metrics
from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.trainer.run import Run, exit_note, start_run
from sparse_rl_megatron.trainer.runtime import distributed as D
from sparse_rl_megatron.trainer.runtime.expected_result import expected_result_line
from sparse_rl_megatron.trainer.runtime.progress import print_step
from sparse_rl_megatron.utils.errors import RunFailed


def train(cfg: TrainConfig) -> dict[str, float]:
    """Run (or resume) ``cfg`` to ``cfg.steps`` rollout steps; returns the last step's metrics."""
    with start_run(cfg) as run:
        try:
            return _loop(cfg, run)
        except RunFailed as err:  # a fault outside the code (a dead engine process, a full disk): one line
            failure = RunFailed(f"{err}; in the {run.heartbeat.where} on rank {D.rank()}; {exit_note(run)}")
            failure.relayed_from_main = getattr(err, "relayed_from_main", False)  # another rank prints it
            raise failure from None
        except Exception as err:  # name where it happened and what was kept; the traceback follows
            err.add_note(f"sparse-rl train: failed in the {run.heartbeat.where} on rank {D.rank()}; {exit_note(run)}")
            raise


def _loop(cfg: TrainConfig, run: Run) -> dict[str, float]:
    hb, main = run.heartbeat, D.is_main()
    stop = _stop_reason(run)  # asked to stop during set-up (a task's warm start can take minutes)
    if stop:
        run.say(f"stopped by {stop} before step {run.step + 1}; nothing new to save")
        return {}
    if run.step == 0 and cfg.eval.at_start and run.plan.eval_data:
        hb.phase(0, "evaluation")
        run.log(0, run.evaluate(0))
    metrics: dict[str, float] = {}
    for step in range(run.step + 1, cfg.steps + 1):
        # 1. rollout + reward (every engine, its share) -> dense recompute (+ reference) -> correction, whole batch
        hb.phase(step, "rollout")
        controller = run.budget_controller
        budget = controller.budget if controller is not None else None  # the adaptive budget of this step
        batch = run.rollout(step, budget)  # the step's prompts (rollout.partial: the first whole groups to finish)
        if controller is not None:  # the next step's budget, from this step's mismatch (same on every rank)
            batch.metrics.update(controller.metrics())
            controller.update_from_metrics(batch.metrics)
            batch.metrics[MN.ROLLOUT_BUDGET_SIGNAL] = controller.last_signal
        # 2. optimizer steps on global-batch slices (the engines' memory still released)
        hb.phase(step, "train")
        t0 = time.perf_counter()
        optimized = run.optimize(batch)
        if not batch.trainable:
            run.say(f"[yellow]step {step}: correction rejected every sample; no optimizer step[/]")
        optimized[MN.TIME_TRAIN_S] = time.perf_counter() - t0
        # 3. checkpoint (periodic, last step, or stop requested on any rank) while the whole learner is awake
        stop = _stop_reason(run)
        every = cfg.checkpoint.save_every
        if stop or step == cfg.steps or (every and step % every == 0):
            hb.phase(step, "save")
            run.save(step)
        # 4. weight sync learner -> engine (version = step), checked by the probe; the learner then sleeps
        hb.phase(step, "sync")
        sync = run.sync(version=step)
        metrics = {**batch.metrics, **optimized, **sync, MN.TIME_SYNC_S: sync[MN.SYNC_SECONDS]}
        # 5. evaluation, metrics
        if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            hb.phase(step, "evaluation")
            metrics.update(run.evaluate(step))
        run.log(step, metrics)
        if main and cfg.log.progress:
            print_step(run.console, step, cfg.steps, metrics)
        if stop:
            run.say(f"stopped at step {step} by {stop}; checkpoint {run.run_dir / 'checkpoints' / f'step_{step}'}")
            return metrics
    _finish(cfg, run)
    return metrics


def _stop_reason(run: Run) -> str | None:
    """Why to stop after this step: any rank's stop request (all ranks agree), else None."""
    reasons = [r for r in D.gather_objects(run.stop.reason) if r]
    return reasons[0] if reasons else None


def _finish(cfg: TrainConfig, run: Run) -> None:
    """Plot, and the before/after held-out accuracy of the run."""
    if not D.is_main() or not run.writer.path.is_file():
        return
    if run.step >= cfg.steps:
        run.say(f"nothing to do: {run.resumed_from} is already at step {run.step} of steps={cfg.steps}")
    if cfg.log.plot:
        from sparse_rl_megatron.observability.plots import PLOT_FILE, plot_metrics

        plot = plot_metrics(run.writer.path, run.run_dir / PLOT_FILE)
        run.say(f"metrics: {run.writer.path}  plot: {plot}  checkpoints: {run.run_dir / 'checkpoints'}")

    records = read_metrics(run.writer.path)
    for mode in (MN.DENSE, MN.SPARSE, MN.ADAPTIVE):
        key, free = MN.eval_key(mode, MN.ACCURACY), MN.eval_key(mode, MN.SHORTCUT_FREE_ACCURACY)
        evals = [r for r in records if r.get(key) is not None]
        if len(evals) >= 2:
            first, last = evals[0], evals[-1]
            line = f"held-out accuracy ({mode}): step {first['step']} {first[key]:.3f} -> step {last['step']} {last[key]:.3f}"
            if first.get(free) is not None and last.get(free) is not None:  # answers not copyable from the prompt
                line += f"; shortcut-free {first[free]:.3f} -> {last[free]:.3f}"
            chain = MN.eval_key(mode, MN.FULL_CHAIN_FRAC)
            if first.get(chain) is not None and last.get(chain) is not None:  # every intermediate state right
                line += f"; full chains {first[chain]:.3f} -> {last[chain]:.3f}"
            run.say(line)
    verdict = expected_result_line(cfg.expect, records)
    if verdict is not None:
        from rich.markup import escape

        run.say(escape(verdict))
