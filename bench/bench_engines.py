"""One rollout step (and the whole training step) with 1 rollout engine vs 2, two ranks under torchrun.

Each configuration is a real ``sparse-rl train`` set-up (``trainer.run.start_run``: learner DP2, the run's
``EnginePool``) on the embedded CPU default's task (``task:modchain``: ``--prompts`` 32 x 8 samples of up to 74 tokens
on an R-KV cache, 4 optimizer steps per rollout), with a 4-step warm start (quality does not matter here). The worker
runs the loop's phases itself, step by step, and times each on every rank: wall seconds and the CPU seconds of the
rank's process (all its threads). ``--engines 1`` is ``rollout.gpus_per_engine=2`` (rank 0 samples all the groups,
rank 1 waits), ``--engines 2`` is ``gpus_per_engine=1`` (half the groups each). The first step is a warm-up; the
table keeps the fastest of the others per phase. Phases: ``rollout`` (``EnginePool.generate``: every engine samples
and scores its share, the samples are exchanged), ``recompute`` (dense old log-probs + correction), ``train`` (the
optimizer steps, engines' memory released around them), ``sync`` (weights to every engine + the probe on each),
``step``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_engines.py            # both configurations, side by side

Not a test: timings on a shared 2-core machine are noisy; the CPU seconds say what the work cost.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "recompute", "train", "sync", "step")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="rollout steps per configuration (the first is a warm-up)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=74, help="response limit (the CPU default's 74; <= 240)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # engines, under torchrun
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: set up a run with ``args.worker`` engines and time its phases step by step."""
    import torch

    torch.set_num_threads(1)
    from sparse_rl_megatron.trainer.runtime import distributed as D
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.trainer.optimize import optimizer_steps
    from sparse_rl_megatron.trainer.run import start_run
    from sparse_rl_megatron.trainer.step import prepare_batch, step_seed
    from sparse_rl_megatron.utils.config_io import load_config

    run_dir = Path(args.out).parent / f"run-{args.worker}"
    cfg = load_config(TrainConfig, ROOT / "configs" / "cpu_default.yaml", [
        f"run_dir={run_dir}", "warm_start={steps: 4, eval_problems: 0}", f"steps={args.steps}",
        # the task and cache bench/README.md records (the default's before issue 20), not whatever it is now
        "model_path=task:modchain", "data.dataset=task:modchain", "rollout.compression.budget=8",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
        f"global_batch_size={args.prompts * args.samples // 4}", f"rollout.gpus_per_engine={3 - args.worker}",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}", "eval.at_start=false", "log.progress=false",
        "log.tensorboard=false", "checkpoint.resume=never"])
    rows = []
    with start_run(cfg) as run:
        line = run.plan.layout.describe()
        for step in range(1, cfg.steps + 1):
            times = {}
            c_step, w_step = time.process_time(), time.perf_counter()
            c0, w0 = c_step, w_step
            records = run.prompts.take(cfg.rollout.prompts_per_step) if D.is_main() else None
            sampling = dataclasses.replace(cfg.rollout.sampling, seed=step_seed(cfg.seed, step))
            samples, metrics = run.pool.generate(records, run.plan.template, cfg.rollout.samples_per_prompt,
                                                 sampling, step)  # what rollout_step runs first
            times["rollout"] = (time.process_time() - c0, time.perf_counter() - w0)
            c0, w0 = time.process_time(), time.perf_counter()
            batch = prepare_batch(run.learner, samples, cfg.correction)
            batch.metrics = {**metrics, **batch.metrics}
            times["recompute"] = (time.process_time() - c0, time.perf_counter() - w0)
            c0, w0 = time.process_time(), time.perf_counter()
            run.pool.release_memory()
            optimizer_steps(run.learner, batch, cfg.optimizer_steps_per_rollout)
            run.pool.resume_memory()
            times["train"] = (time.process_time() - c0, time.perf_counter() - w0)
            c0, w0 = time.process_time(), time.perf_counter()
            run.sync(version=step)
            times["sync"] = (time.process_time() - c0, time.perf_counter() - w0)
            times["step"] = (time.process_time() - c_step, time.perf_counter() - w_step)
            engine_s = (batch.metrics["time/rollout_engine_min_s"], batch.metrics["time/rollout_s"])
            rows.append({"step": step, "ranks": D.gather_objects(times), "engine_s": engine_s,
                         "tokens": sum(s.response_length for s in batch.samples)})
        if D.is_main():
            Path(args.out).write_text(json.dumps({"layout": line, "rows": rows}))


def launch(engines: int, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"engines-{engines}.json"
    port = 29500 + os.getpid() % 1000 + engines
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           str(Path(__file__).resolve()), "--worker", str(engines), "--out", str(out), "--steps", str(args.steps),
           "--prompts", str(args.prompts), "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT),
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"engines={engines} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def best(result: dict, phase: str) -> tuple[float, float, float]:
    """(wall s, CPU s of rank 0 + rank 1, CPU s of the busier rank) of the fastest non-warm-up step."""
    rows = result["rows"][1:] or result["rows"]
    walls = [(max(r["ranks"][k][phase][1] for k in (0, 1)), r) for r in rows]
    wall, row = min(walls, key=lambda x: x[0])
    cpu = [row["ranks"][k][phase][0] for k in (0, 1)]
    return wall, sum(cpu), max(cpu)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    results = {e: launch(e, args, work) for e in (1, 2)}
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; {args.prompts} prompts x {args.samples} samples of up to {args.max_new_tokens} "
          "tokens, DP2 learner, 2 ranks")
    for e, r in results.items():
        print(f"# engines={e}: {r['layout']}")
    print("\n| phase | engines | wall s | x 1 engine | CPU s (both ranks) | CPU s (busier rank) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for phase in PHASES:
        base = best(results[1], phase)[0]
        for e in (1, 2):
            wall, cpu, busy = best(results[e], phase)
            print(f"| {phase} | {e} | {wall:.2f} | {base / wall:.2f} | {cpu:.2f} | {busy:.2f} |")
    for e, r in results.items():
        rows = r["rows"][1:] or r["rows"]
        fast = min(rows, key=lambda x: x["engine_s"][1])
        print(f"# engines={e}: engine generate min/max {fast['engine_s'][0]:.2f} / {fast['engine_s'][1]:.2f} s,"
              f" {fast['tokens']} tokens; per-step rollout walls "
              + ", ".join(f"{max(x['ranks'][k]['rollout'][1] for k in (0, 1)):.2f}" for x in r["rows"]))
    same = [[x["tokens"] for x in r["rows"]] for r in results.values()]
    print(f"# response tokens per step, 1 vs 2 engines (the same samples): {same[0]} vs {same[1]}"
          + ("" if same[0] == same[1] else "  DIFFERENT"))


if __name__ == "__main__":
    main()
