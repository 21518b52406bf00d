"""A differential soak of the ``sparse_kv`` plugin against the HF reference engine, under memory pressure (issue 25).

SGLang's CPU engine runs the plugin the way a GPU rollout engine runs it: a packed KV pool (``max_total_tokens`` a
few hundred tokens, so a freed slot is handed out again within a few decode steps), the radix cache on (SGLang's
default) or off, prompts split into small prefill chunks, and, on some engines, SGLang's forced retraction
(``SGLANG_TEST_RETRACT``). Each round sends one batch of GRPO groups whose prompts share prefixes (with earlier
rounds' too, so later rounds hit the tree), each group with its own compression (rkv, snapkv, streamingllm in both
scopes and several budgets, or dense ``none``), decoding side by side. Every finished sample is replayed by
``HFRolloutEngine.teacher_forced`` with the same compression: its sampler log-probs must agree within the tolerance of
``tests/sglang`` (``tests/numerics.hf_logprob_tolerance``, per sample), with the same compression record (events,
peak, kept digest). SGLang's strict memory checkers are on (a leaked or double-freed slot ends the scheduler, and the
soak). A request the plugin refused after a retraction (already compressed) is resubmitted as a new draw and counted
(``redraws``; none expected since issue 25 item 4: compressed requests are not retracted, ``sglang_ext/admission.py``).

Server settings are drawn from the seed once per engine (an engine serves ``--rounds-per-engine`` rounds, then the
next engine starts with the next draw); workloads once per round. A failure prints the engine's settings, the
round's seed and the sample, and exits 1 (``--keep-going`` runs on and reports every failure).

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python bench/soak_plugin.py --minutes 10 --seed 0

``--fault stale_tables`` runs the plugin with its ``ReqToTokenPool.write`` hook off (the defect of issue 25): the
soak must then fail. ``tests/sglang/test_soak_plugin.py`` runs two rounds of it in the suite.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the suite's error model: the tolerance asked of every sample
import numerics  # noqa: E402
MODEL_SEED, INIT_STD = 3, 0.2
"""The tiny Qwen2 of the SGLang test tier (``tests/sglang/sglang_helpers.py``)."""
SERVER = {"method": "rkv", "budget": 12, "window": 3, "buffer": 4}
"""The server's compression: it sizes the query ring (alpha = 3) and admission (B + W = 16); requests pick theirs
within it."""
STRICT_MEMORY_CHECKS = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
                        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"}
VOCAB = 512


@dataclass(frozen=True)
class Settings:
    """One engine's server settings."""

    pool: int
    """``max_total_tokens``: small, so freed slots are reused within a few steps."""
    radix: bool
    chunk: int
    """``chunked_prefill_size``: prompts longer than this are prefilled in pieces."""
    retract_interval: int
    """``SGLANG_TEST_RETRACT_INTERVAL`` (forced retraction every that many steps); 0: only the pool's own."""
    max_running: int | None


@dataclass
class Job:
    """One GRPO group: a prompt, n samples, the group's compression and response length."""

    prompt: list[int]
    n: int
    compression: dict
    max_new_tokens: int


@dataclass
class Tally:
    rounds: int = 0
    samples: int = 0
    compressed_samples: int = 0
    events: int = 0
    retracted_samples: int = 0
    redraws: int = 0
    engines: int = 0
    max_delta: float = 0.0
    max_delta_over_bound: float = 0.0
    """The largest sample's max |delta log-prob| / its tolerance (``numerics.hf_logprob_tolerance``): < 1 passes."""
    failures: list = field(default_factory=list)


PRESSURED = Settings(pool=300, radix=True, chunk=8, retract_interval=0, max_running=None)
"""The settings of ``tests/sglang/test_plugin_under_pressure.py`` (``--pressured``): where stale slots were read."""


def draw_settings(rng: random.Random) -> Settings:
    return Settings(pool=rng.choice([200, 260, 300, 400]), radix=rng.random() < 0.75, chunk=rng.choice([8, 16, 64]),
                    retract_interval=rng.choice([0, 0, 3, 5]), max_running=rng.choice([None, None, 8]))


def draw_compression(rng: random.Random) -> dict:
    method = rng.choice(["rkv", "rkv", "snapkv", "streamingllm", "none"])
    if method == "none":
        return {"method": "none"}
    budget = rng.choice([6, 8, 12])
    return {**SERVER, "method": method, "budget": budget, "buffer": rng.choice([2, 4]) if budget < 12 else 4,
            "scope": rng.choice(["response", "all"]), "sink_tokens": 2}


def draw_workload(rng: random.Random, stems: list[list[int]]) -> list[Job]:
    """3-5 groups, n in 1..8; prompts of 3-30 tokens, most extending one of the stems (shared prefixes: the same
    group's samples, other groups, earlier rounds), some new stems."""
    jobs = []
    for _ in range(rng.randint(3, 5)):
        if stems and rng.random() < 0.7:
            stem = rng.choice(stems)
            prompt = stem[:rng.randint(1, len(stem))] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 8))]
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 22))]
            stems.append(prompt)
        jobs.append(Job(prompt=prompt[:30] if len(prompt) >= 3 else prompt + [7, 9, 11][:3 - len(prompt)],
                        n=rng.randint(1, 8), compression=draw_compression(rng),
                        max_new_tokens=rng.randint(16, 40)))
    return jobs


def start_engine(model_dir: Path, settings: Settings, fault: str = ""):
    from sglang_ext.config import FAULT_ENV, scheduler_env

    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    extra = {"chunked_prefill_size": settings.chunk}
    config = SGLangEngineConfig(model_path=str(model_dir), compression=CompressionConfig(**SERVER), dtype="float32",
                                max_total_tokens=settings.pool, radix_cache=settings.radix, kept_digest=True,
                                max_running_requests=settings.max_running, max_resubmits=0, extra_args=extra)
    env = dict(STRICT_MEMORY_CHECKS)
    if settings.retract_interval:
        env.update(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL=str(settings.retract_interval))
    if fault:
        env[FAULT_ENV] = fault
    with scheduler_env(**env):
        return SGLangRolloutEngine(config)


MAX_DRAWS = 50
"""Fresh draws of one request refused after retractions before the round fails (the pool is too small)."""


def generate(engine, jobs: list[Job], seed: int) -> tuple[dict, int]:
    """One batch of every job's samples (sent together); refused retractions are redrawn. Returns
    ``{(job, index): Sample}`` and the number of redraws."""
    from sparse_rl_megatron.rollout.engine import SamplingParams

    sampling = [SamplingParams(temperature=1.0, max_new_tokens=j.max_new_tokens, ignore_eos=True, seed=seed)
                for j in jobs]
    todo = [(g, i) for g, j in enumerate(jobs) for i in range(j.n)]
    done, redraws = {}, 0
    for attempt in range(MAX_DRAWS):
        params = [engine._sampling(sampling[g], g, i, attempt, jobs[g].compression) for g, i in todo]
        outs = engine.client.generate([jobs[g].prompt for g, _ in todo], params, groups=[g for g, _ in todo])
        retry = []
        for (g, i), out in zip(todo, outs):
            if engine._refused(out):
                retry.append((g, i))
            else:
                sample = engine._sample(out, jobs[g].prompt, jobs[g].prompt, g, i, sampling[g])
                sample.metadata["redraws"] = attempt
                done[(g, i)] = sample
        if not retry:
            return done, redraws
        redraws += len(retry)
        todo = retry
    raise RuntimeError(f"{len(todo)} request(s) refused after retractions {MAX_DRAWS} times")


def check_round(hf_model, jobs: list[Job], done: dict) -> tuple[float, float, list[str]]:
    """Every sample against ``teacher_forced`` with its group's compression: (max |delta log-prob|, max of
    |delta| / tolerance, failures)."""
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    worst, ratio, failures = 0.0, 0.0, []
    for g, job in enumerate(jobs):
        samples = [done[(g, i)] for i in range(job.n)]
        ref = HFRolloutEngine(hf_model, compression=CompressionConfig(**job.compression), show_progress=False)
        reference = ref.teacher_forced([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        for s, r in zip(samples, reference):
            delta = (s.sampler_logprobs - r.sampler_logprobs).abs()
            d = float(delta.max())
            tol = numerics.hf_logprob_tolerance(hf_model, [s.prompt_ids], [s.response_ids])
            worst, ratio = max(worst, d), max(ratio, d / tol)
            got = (s.compression.events, s.compression.peak_kv_tokens, s.compression.kept_digest)
            want = (r.compression.events, r.compression.peak_kv_tokens, r.compression.kept_digest)
            if not d <= tol or got != want:
                first = int((delta > tol).nonzero()[0, 0]) if not d <= tol else None
                failures.append(f"group {g} ({job.compression}) sample {s.index_in_group}: max |delta| {d:.3g} "
                                f"(first token over {tol:.3g}: {first}), record {got} vs reference {want}, "
                                f"retractions {s.metadata['retractions']}, redraws {s.metadata['redraws']}")
    return worst, ratio, failures


def soak(*, seed: int, minutes: float = 0.0, max_rounds: int = 0, rounds_per_engine: int = 4,
         settings: Settings | None = None, fault: str = "", keep_going: bool = False, log=print) -> Tally:
    """Rounds until ``minutes`` pass (the round running then finishes) or ``max_rounds`` ran; ``settings`` fixes
    every engine's settings (default: drawn). Stops at the first failing round unless ``keep_going``."""
    from sparse_rl_megatron.models.tiny import build_tiny_model, save_tiny_hf_checkpoint

    rng = random.Random(seed)
    tally = Tally()
    deadline = time.monotonic() + 60 * minutes if minutes else None
    hf_model = build_tiny_model(seed=MODEL_SEED, init_std=INIT_STD)
    with tempfile.TemporaryDirectory(prefix="soak-plugin-") as tmp:
        model_dir = save_tiny_hf_checkpoint(Path(tmp) / "tiny-qwen2", seed=MODEL_SEED, init_std=INIT_STD)
        while True:
            engine_settings = settings or draw_settings(rng)
            engine = start_engine(model_dir, engine_settings, fault)
            tally.engines += 1
            log(f"engine {tally.engines}: {engine_settings}")
            stems: list[list[int]] = []
            try:
                for _ in range(rounds_per_engine):
                    round_seed = rng.randrange(2 ** 31)
                    jobs = draw_workload(random.Random(round_seed), stems)
                    done, redraws = generate(engine, jobs, round_seed)
                    worst, ratio, failures = check_round(hf_model, jobs, done)
                    samples = list(done.values())
                    tally.rounds += 1
                    tally.samples += len(samples)
                    tally.compressed_samples += sum(s.compression.events > 0 for s in samples)
                    tally.events += sum(s.compression.events for s in samples)
                    tally.retracted_samples += sum(s.metadata["retractions"] > 0 for s in samples)
                    tally.redraws += redraws
                    tally.max_delta = max(tally.max_delta, worst)
                    tally.max_delta_over_bound = max(tally.max_delta_over_bound, ratio)
                    log(f"round {tally.rounds} (seed {round_seed}): {len(jobs)} groups, {len(samples)} samples, "
                        f"{sum(s.compression.events > 0 for s in samples)} compressed, "
                        f"{sum(s.metadata['retractions'] > 0 for s in samples)} retracted, {redraws} redraws, "
                        f"max |delta| {worst:.3g} ({ratio:.2g} of its bound)"
                        + (f", {len(failures)} FAILED" if failures else ""))
                    for line in failures:
                        log(f"  FAIL {line}")
                    tally.failures += [{"engine": dataclasses.asdict(engine_settings), "round_seed": round_seed,
                                        "jobs": [dataclasses.asdict(j) for j in jobs], "failure": f}
                                       for f in failures]
                    out_of_time = deadline is not None and time.monotonic() > deadline
                    if (failures and not keep_going) or out_of_time or (max_rounds and tally.rounds >= max_rounds):
                        return tally
            finally:
                engine.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=5.0, help="run rounds until this many minutes passed")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (0: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds-per-engine", type=int, default=4)
    p.add_argument("--pressured", action="store_true", help="every engine with PRESSURED's settings (not drawn)")
    p.add_argument("--fault", default="", help="test-only fault of the plugin (stale_tables: no write hook)")
    p.add_argument("--keep-going", action="store_true", help="report every failing round instead of stopping")
    p.add_argument("--json", default="", help="also write the tally (and every failure's case) here")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    start = time.monotonic()
    tally = soak(seed=args.seed, minutes=args.minutes, max_rounds=args.rounds, fault=args.fault,
                 settings=PRESSURED if args.pressured else None,
                 rounds_per_engine=args.rounds_per_engine, keep_going=args.keep_going)
    summary = {k: v for k, v in dataclasses.asdict(tally).items() if k != "failures"}
    summary.update(failed_samples=len(tally.failures), seed=args.seed, wall_s=round(time.monotonic() - start, 1),
                   first_failure=tally.failures[0] if tally.failures else None)
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "failures": tally.failures}, indent=1))
    if tally.failures:
        print(f"FAILED: {len(tally.failures)} sample(s) off the reference (tolerance: numerics.hf_logprob_tolerance)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
