"""Set-up and tear-down of one training run, and the services the loop calls (log, save, sync, evaluate).

Order of set-up (each step fails with one clear line before the costly ones start):
preflight (every rank: config vs files, registries, world size, the rollout layout; the data is loaded) ->
process groups -> rank 0 takes the run-directory lock and decides fresh start (earlier outputs archived) or
resume (metrics past the checkpoint dropped) -> models built once (tiny / task warm start) -> learner
(+ reference policy when KL is on) -> the learner goes to sleep (``learner.offload``) -> every engine and its rank's
reward (``engine_pool/pool.py``), each sizing its memory from what the sleeping learner left free -> checkpoint loaded
-> weights synced to every engine and probed on each. The learner and the engines take turns on the device from
there (``runtime/device_turns.py``): every service below enters the turn it needs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import yaml

from sparse_rl_megatron.learner import Learner
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.observability.metrics_writer import METRICS_FILE, MetricsWriter
from sparse_rl_megatron.observability.plots import PLOT_FILE
from sparse_rl_megatron.rewards.registry import REWARDS
from sparse_rl_megatron.trainer.checkpointing import checkpoints
from sparse_rl_megatron.trainer.checkpointing.resume import choose
from sparse_rl_megatron.trainer.checkpointing.state import TrainerState
from sparse_rl_megatron.trainer.config import TrainConfig
from sparse_rl_megatron.trainer.engine_pool.pool import EnginePool
from sparse_rl_megatron.trainer.engine_pool.weight_probe import probe_sequence, probe_tolerance
from sparse_rl_megatron.trainer.evaluation import EVAL_DIR, evaluate_pool
from sparse_rl_megatron.trainer.optimize import optimizer_steps
from sparse_rl_megatron.trainer.partial_rollouts import PartialRollouts, lag_split_metrics
from sparse_rl_megatron.trainer.run_plan import RunPlan, preflight
from sparse_rl_megatron.trainer.runtime.device_turns import DeviceTurns
from sparse_rl_megatron.trainer.runtime import distributed as D
from sparse_rl_megatron.trainer.runtime.model_dirs import export_for_engine, prepare_model
from sparse_rl_megatron.trainer.runtime.progress import HEARTBEAT_DIR, Heartbeat
from sparse_rl_megatron.trainer.runtime.prompts import PromptOrder
from sparse_rl_megatron.trainer.step import RolloutBatch, prepare_batch, rollout_samples
from sparse_rl_megatron.trainer.runtime.run_dir import RunDirLock, archive_previous_outputs
from sparse_rl_megatron.trainer.runtime.signals import StopRequest
from sparse_rl_megatron.utils.config_io import to_dict

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from sparse_rl_megatron.compression.budget_controller import BudgetController
    from sparse_rl_megatron.data.record import MathRecord
    from sparse_rl_megatron.learner.batch import SequenceBatch
    from sparse_rl_megatron.learner.learner import Learner
    from sparse_rl_megatron.observability.metrics_writer import MetricsWriter
    from sparse_rl_megatron.trainer.checkpointing.resume import Choice
    from sparse_rl_megatron.trainer.engine_pool.pool import EnginePool
    from sparse_rl_megatron.trainer.runtime.progress import Heartbeat
    from sparse_rl_megatron.trainer.runtime.prompts import PromptOrder
    from sparse_rl_megatron.trainer.runtime.signals import StopRequest

CONFIG_FILE = "config.yaml"
OUTPUTS = (CONFIG_FILE, METRICS_FILE, PLOT_FILE, "tensorboard", checkpoints.CHECKPOINTS_DIR, EVAL_DIR, HEARTBEAT_DIR)
"""What a fresh start moves to ``archive/`` (the built models under ``model/`` are kept and reused)."""


@dataclass
class Run:
    """A started run: everything the loop touches, built before the run is (``start_run``). None only where a part
    does not exist: the reference policy without KL, the budget controller without the adaptive budget, the
    rank-0-only prompt order and metrics writer on the other ranks, ``resumed_from`` on a fresh start."""

    cfg: TrainConfig
    plan: RunPlan
    run_dir: Path
    console: "Console"
    learner: "Learner"
    ref_learner: "Learner | None"
    """The reference policy (the initial model) when ``learner.loss.kl_coef`` > 0."""
    pool: "EnginePool"
    """The run's rollout engines as this rank sees them (its own engines and reward)."""
    probe: "SequenceBatch"
    """The weight-sync probe sequence (``engine_pool/weight_probe.py``)."""
    turns: DeviceTurns
    """Who holds the device, the engines or the learner (``runtime/device_turns.py``)."""
    heartbeat: "Heartbeat"
    stop: "StopRequest"
    prompts: "PromptOrder | None"
    """The training prompts' order (rank 0)."""
    budget_controller: "BudgetController | None"
    """The adaptive KV budget's ``BudgetController`` (``rollout.adaptive_budget.enabled``), else None."""
    partial: "PartialRollouts | None" = None
    """The partial rollouts' groups in flight (``rollout.partial.enabled``), else None."""
    writer: "MetricsWriter | None" = None
    """``metrics.jsonl`` and TensorBoard (rank 0; opened once the resume step is known)."""
    step: int = 0
    """Rollout steps completed (the checkpoint's step when resumed)."""
    resumed_from: Path | None = None
    start_probe: "torch.Tensor | None" = None
    """The learner's log-probs of ``probe`` as built (taken before it first slept): what the engines, which loaded the
    same weights from disk, are probed against at a fresh start."""

    # ------------------------------------------------------------------------------------------------ log
    def say(self, text: str) -> None:
        if D.is_main():
            self.console.print(text)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if D.is_main():
            self.writer.write(step, metrics)

    # ------------------------------------------------------------------------------------------- rollout
    def take_prompts(self, count: int) -> "list[MathRecord] | None":
        """Rank 0's next ``count`` training problems (None on the other ranks)."""
        return self.prompts.take(count) if D.is_main() else None

    def rollout(self, step: int, budget: int | None) -> RolloutBatch:
        """Rollout and reward on every engine (the engines' turn): the step's groups sampled whole, or with
        ``rollout.partial`` the first groups to finish (``partial_rollouts.py``); then the dense recompute (+ reference)
        and the correction on the whole batch (the recompute turn: the learners' weights). ``budget``: this step's KV
        budget (the adaptive budget's; None: the engines' own)."""
        cfg = self.cfg
        self.turns.enter("engines")
        if self.partial is None:
            samples, metrics = rollout_samples(self.pool, self.take_prompts(cfg.rollout.prompts_per_step),
                                               self.plan.template, cfg.rollout.samples_per_prompt,
                                               cfg.rollout.sampling, cfg.seed, step, budget)
        else:
            samples, metrics = self.partial.step(self.pool, self.take_prompts, self.plan.template,
                                                 cfg.rollout.sampling, cfg.seed, step, budget)
        self.turns.enter("recompute")
        batch = prepare_batch(self.learner, samples, cfg.correction, self.ref_learner)
        if self.partial is not None:
            metrics.update(lag_split_metrics(batch.prepared, samples, step - 1))
        batch.metrics = {**metrics, **batch.metrics}
        return batch

    def optimize(self, batch: RolloutBatch) -> dict[str, float]:
        """The optimizer steps on ``batch`` (the train turn: the whole policy learner awake, the reference asleep)."""
        self.turns.enter("train")
        return optimizer_steps(self.learner, batch, self.cfg.optimizer_steps_per_rollout,
                               self.cfg.log.progress and D.is_main())

    # ----------------------------------------------------------------------------------------------- sync
    def push(self, version: int) -> dict[str, float]:
        """Push the learner's weights to every engine as ``version`` (the sync turn: the engines' weights back, their
        KV pool not yet)."""
        self.turns.enter("sync")
        return self.pool.sync(self.learner, version, self.cfg.sync.bucket_mb)

    def probe_engines(self, version: int) -> dict[str, float]:
        """The learner's probe log-probs (its weights are awake in the sync turn), then the device to the engines,
        and every engine probed against them (``version``: the one just pushed)."""
        learner_lp = self.learner.logprobs(self.probe) if self.cfg.sync.probe else None
        self.turns.enter("engines")
        if learner_lp is None:
            return {}
        return self.pool.probe(learner_lp, self.probe, probe_tolerance(self.cfg, self.learner), version)

    def sync(self, version: int) -> dict[str, float]:
        """``push`` then ``probe_engines``."""
        metrics = self.push(version)
        metrics.update(self.probe_engines(version))
        return metrics

    def probe_start(self) -> dict[str, float]:
        """A fresh start: probe the engines, which loaded the built model from disk, against the learner as built
        (version 0, nothing pushed)."""
        if self.start_probe is None:
            return {}
        self.turns.enter("engines")
        return self.pool.probe(self.start_probe, self.probe, probe_tolerance(self.cfg, self.learner), self.step)

    # ----------------------------------------------------------------------------------------------- save
    def save(self, step: int) -> Path:
        """A checkpoint of ``step`` (the train turn: the optimizer state is read; the loop saves before the weight
        push, which gives the engines their weights back)."""
        self.turns.enter("train")
        state = D.on_main(lambda: TrainerState.capture(self, step, self.cfg.seed))
        return checkpoints.save(self.run_dir, step, self.learner, state, self.cfg.checkpoint.keep_last)

    # ------------------------------------------------------------------------------------------- evaluate
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy of the live weights (every engine evaluates its share; every rank gets the metrics).
        ``sparse`` at the stated budget; ``adaptive`` (if asked) at the controller's current budget, the one the
        next step samples with (``trainer/evaluation.py``)."""
        if not self.plan.eval_data:
            return {}
        self.turns.enter("engines")
        return evaluate_pool(self.pool, self.plan.eval_data, self.cfg, self.plan.template, step, self.run_dir,
                             controller_budget=None if self.budget_controller is None
                             else self.budget_controller.budget)


def _claim_run_dir(cfg: TrainConfig, run_dir: Path, stack: contextlib.ExitStack) -> tuple["Choice", list[str]]:
    """Rank 0: lock the run directory, choose fresh start or resume (the newest intact checkpoint: ``resume.py``),
    write the resolved config. Returns the choice and what to tell the user."""
    lock = stack.enter_context(RunDirLock(run_dir))
    notes = []
    if lock.taken_over:
        notes.append(f"took over the lock of a run that is no longer alive (pid {lock.taken_over.get('pid')} on "
                     f"{lock.taken_over.get('host')})")
    choice = choose(cfg.checkpoint.resume, run_dir)
    notes += choice.notes
    if choice.path is None:
        archived = archive_previous_outputs(run_dir, OUTPUTS)
        if archived:
            notes.append(f"previous outputs of {run_dir} moved to {archived}")
    else:
        old = run_dir / CONFIG_FILE
        if old.is_file():
            old.replace(run_dir / f"{CONFIG_FILE}.before-step{choice.state.step}")
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return choice, notes


@dataclass
class _Models:
    """What ``_build_models`` built."""

    learner: "Learner"
    ref_learner: "Learner | None"
    pool: "EnginePool"
    probe: "SequenceBatch"
    turns: DeviceTurns
    start_probe: "torch.Tensor | None"


def _build_models(cfg: TrainConfig, plan: RunPlan, run_dir: Path, stack: contextlib.ExitStack,
                  say: Callable[[str], None], stop: StopRequest) -> _Models:
    """Learner (+ reference), every engine and its rank's reward, the engines started once the learners sleep; rank 0
    builds the model directories first (a stop asked during a task's warm start ends the run there: ``StoppedEarly``,
    on every rank)."""
    dirs = D.on_main(lambda: prepare_model(cfg, plan.task, run_dir, should_stop=lambda: stop.reason))
    for note in dirs.notes:
        say(note)
    facts = plan.device_facts
    learner = Learner(cfg.learner_config(dirs.learner), device_facts=facts)
    ref_learner = None
    if cfg.learner.loss.kl_coef > 0:  # the reference policy is the initial model, also after a resume
        ref_learner = Learner(cfg.learner_config(dirs.learner), trainable=False, device_facts=facts)
    hf_dir = dirs.engine_hf or export_for_engine(learner, run_dir)
    probe = probe_sequence(learner.arch.vocab_size, cfg.sync.probe_tokens, cfg.seed)
    start_probe = learner.logprobs(probe) if cfg.sync.probe else None
    say(plan.layout.describe())
    turns = DeviceTurns(learner, ref_learner)
    pool = turns.start_engines(lambda: EnginePool.start(cfg, plan.layout, hf_dir, stack, lambda: make_reward(cfg, plan)))
    return _Models(learner, ref_learner, pool, probe, turns, start_probe)


def make_reward(cfg: TrainConfig, plan: RunPlan):
    """The reward of a rank that drives an engine (a context manager: the ``math`` reward owns a verifier process
    pool, one per engine rank)."""
    factory = REWARDS.get(plan.reward)
    return factory(cfg.reward.verifier) if plan.reward == "math" else factory()


@contextlib.contextmanager
def start_run(cfg: TrainConfig):
    """Set up a run (see the module docstring); yields a ``Run``; closes the reward, logs and lock at the end."""
    from rich.console import Console

    plan = preflight(cfg, D.env_world_size())
    D.init(cfg.phase_timeout_s)
    with contextlib.ExitStack() as stack:
        console, run_dir = Console(soft_wrap=True), Path(cfg.run_dir)

        def say(text: str) -> None:
            if D.is_main():
                console.print(text)

        stack.callback(D.shutdown)
        choice, notes = D.on_main(lambda: _claim_run_dir(cfg, run_dir, stack))
        resume = None if choice.path is None else str(choice.path)
        for note in notes:
            say(note)
        stop = stack.enter_context(StopRequest(run_dir, announce=D.env_local_rank() == 0))
        if D.is_main():
            stop.clear_stop_file()  # it asked the previous process to stop; this one has just started
        D.wait_for_main()
        heartbeat = Heartbeat(run_dir, D.rank(), cfg.log.heartbeat)
        models = _build_models(cfg, plan, run_dir, stack, say, stop)
        budget_controller = None
        if cfg.rollout.adaptive_budget.enabled:
            from sparse_rl_megatron.compression.budget_controller import BudgetController

            budget_controller = BudgetController(cfg.rollout.adaptive_budget, cfg.rollout.compression.budget)
        run = Run(cfg=cfg, plan=plan, run_dir=run_dir, console=console, learner=models.learner,
                  ref_learner=models.ref_learner, pool=models.pool, probe=models.probe, turns=models.turns,
                  start_probe=models.start_probe, heartbeat=heartbeat, stop=stop,
                  prompts=PromptOrder(plan.train_data.records, cfg.seed, cfg.data.shuffle) if D.is_main() else None,
                  budget_controller=budget_controller,
                  partial=PartialRollouts(cfg.rollout.partial, cfg.rollout.prompts_per_step,
                                          cfg.rollout.samples_per_prompt) if cfg.rollout.partial.enabled else None)
        if resume is not None:  # an older intact checkpoint if this one does not load (resume.py)
            from sparse_rl_megatron.trainer.checkpointing.resume import load as load_checkpoint

            run.turns.enter("train")
            choice = load_checkpoint(run, choice)
            run.resumed_from = choice.path
            for warning in choice.state.restore(run, D.world_size()):
                run.say(f"[yellow]warning[/]: {warning}")
            if D.is_main() and not choice.rng_restored and choice.state.world_size == D.world_size():
                run.say("[yellow]warning[/]: the checkpoint has no RNG states for this rank: they are not restored")
        if D.is_main():
            run.writer = MetricsWriter(run.run_dir, tensorboard=cfg.log.tensorboard,
                                       resume_step=run.step if resume is not None else None)
            stack.callback(run.writer.close)
            run.say(f"[bold]sparse-rl train[/]: {run.learner.describe()}; world {D.world_size()}; data "
                    f"{cfg.data.dataset} ({len(plan.train_data)} problems); KV {cfg.rollout.compression.describe()}; "
                    f"{cfg.steps} steps x {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.samples_per_prompt} "
                    f"samples, {cfg.optimizer_steps_per_rollout} optimizer step(s) each")
        # the engine serves the learner's weights from here on: pushed after a resume, probed always
        startup = run.sync(version=run.step) if resume is not None else run.probe_start()
        if MN.SYNC_PROBE_MEAN_ABS_DIFF in startup:
            count = run.plan.layout.num_engines
            run.say(f"engine '{cfg.rollout.engine}' serves the learner's weights (version {run.step}) on "
                    f"{'all ' + str(count) + ' engines' if count > 1 else 'its engine'}: probe mean |log-prob diff| "
                    f"{startup[MN.SYNC_PROBE_MEAN_ABS_DIFF]:.2g} (max {startup[MN.SYNC_PROBE_MAX_ABS_DIFF]:.2g})")
        yield run


def exit_note(run: Run) -> str:
    """Where a run that ends early left its work (for messages)."""
    latest = checkpoints.latest_checkpoint(run.run_dir)
    where = f"last complete checkpoint: {latest}" if latest else "no checkpoint yet"
    return f"{where}; rerun the same command to resume (checkpoint.resume: auto)"

