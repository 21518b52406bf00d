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

Rounds mix in events (``--events``, all by default on the command line, none in ``soak()``'s default; drawn per
round from its seed, ``EVENTS``): aborts of some requests mid-decode through SGLang's abort path, groups arriving
while the others decode, a weight update through the trainer's path (``update_weights``, which flushes the radix
cache) before the round with the reference moved to the same new weights, a bare cache flush, SGLang's retract pause
mid-decode with a flush and a continue (``pause``: compressed requests held in place). Aborted samples are
not checked (the others are, and the strict checkers watch the pool); streamed requests (the victims, the one whose
progress times the arrivals) are checked on their log-probs only: SGLang sends a streamed request's request-level
custom info, the plugin's record, with its first chunk only.

Server settings are drawn from the seed once per engine (an engine serves ``--rounds-per-engine`` rounds, then the
next engine starts with the next draw); workloads once per round. A failure prints the engine's settings, the
round's seed and the sample, and exits 1 (``--keep-going`` runs on and reports every failure).

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python bench/soak_plugin.py --minutes 10 --seed 0

``--fault stale_tables`` runs the plugin with its ``ReqToTokenPool.write`` hook off (the defect of issue 25): the
soak must then fail; ``--fault abort_insert`` (an aborted compressed request goes into the radix tree whole) and
``--fault no_flush`` (the engine's cache flush a no-op: KV of the old weights stays in the tree) are the events'
defects. ``tests/sglang/test_soak_plugin.py`` runs two drawn rounds and one round per event in the suite.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
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
    backend: str = "torch_native"
    """The plugin's inner attention backend: ``torch_native``, or ``triton`` (on CPU: SGLang's Triton kernels in
    Triton's interpreter, the kernels and index building a GPU runs; ``--triton-share``)."""


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
    triton_engines: int = 0
    """Engines on the triton backend (``--triton-share``)."""
    aborted: int = 0
    """Samples aborted mid-decode (``abort`` events; a victim that finished before its abort landed is checked)."""
    late_samples: int = 0
    """Samples of late groups (``arrive`` events)."""
    arrivals_mid_decode: int = 0
    """Rounds whose late groups went in while the request timing them was still decoding (else: after it ended)."""
    weight_updates: int = 0
    flushes: int = 0
    pauses: int = 0
    """Rounds paused mid-decode (``pause`` events): ``pause_generation(mode="retract")``, a flush, then continued."""
    pauses_in_place: int = 0
    """Pauses that found compressed requests running: held in place (``sglang_ext/pause.py``), the flush refused."""
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


TRITON_KV_SPLITS = 2
"""Triton decode KV splits on a triton engine (the GPU default is 8): 2 still runs the split-combining stage at a
quarter of the interpreter's time (as tests/sglang/test_triton_interpreter.py)."""


def with_backend(settings: Settings, rng: random.Random, triton_share: float) -> Settings:
    """``settings`` on the triton backend with probability ``triton_share`` (drawn from ``rng``, a generator of its
    own: the torch_native draws of a seed stay what they were)."""
    if triton_share > 0 and rng.random() < triton_share:
        return dataclasses.replace(settings, backend="triton")
    return settings


def start_engine(model_dir: Path, settings: Settings, fault: str = ""):
    from sglang_ext.config import FAULT_ENV, scheduler_env

    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
    from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

    extra = {"chunked_prefill_size": settings.chunk}
    if settings.backend == "triton":
        extra["triton_attention_num_kv_splits"] = TRITON_KV_SPLITS
    config = SGLangEngineConfig(model_path=str(model_dir), compression=CompressionConfig(**SERVER), dtype="float32",
                                max_total_tokens=settings.pool, radix_cache=settings.radix, kept_digest=True,
                                max_running_requests=settings.max_running, max_resubmits=0, extra_args=extra,
                                inner_backend="triton" if settings.backend == "triton" else "")   # "": torch_native on CPU
    env = dict(STRICT_MEMORY_CHECKS)
    if settings.retract_interval:
        env.update(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL=str(settings.retract_interval))
    if fault:
        env[FAULT_ENV] = fault
    with scheduler_env(**env):
        return SGLangRolloutEngine(config)


MAX_DRAWS = 50
"""Fresh draws of one request refused after retractions before the round fails (the pool is too small)."""
EVENTS = ("abort", "arrive", "update", "flush", "pause")
"""Events a round may mix in (``--events``): ``abort``: some requests are aborted mid-decode through SGLang's abort
path (``TokenizerManager.abort_request`` by rid, what ``/abort_request`` does); ``arrive``: some groups are submitted
while the others decode; ``update``: before the round, perturbed weights go through ``SGLangRolloutEngine
.update_weights`` (the trainer's path: weight-update session, tensor buckets, radix-cache flush) and the reference
takes the same weights; ``flush``: before the round, the radix cache is flushed (``flush_cache``); ``pause``: once
the first request has some response tokens, SGLang's retract pause (``pause_generation(mode="retract")``, an RL
driver's pause before a weight sync), an immediate cache flush, and ``continue_generation``: compressed requests
running then are held in place (the flush is refused), otherwise SGLang retracts and re-prefills every request
after the flush (issue 41)."""
SOAK_FAULTS = ("no_flush",)
"""Faults of the soak itself (not the plugin's ``SPARSE_RL_KV_FAULT``): ``no_flush``: the engine never flushes its
radix cache (a weight update leaves the old weights' KV in the tree)."""
PERTURB = 0.05
"""A weight update adds N(0, (PERTURB * std of the tensor)^2) to every parameter: log-probs move by far more than
the tolerance, so KV left from the old weights shows."""


@dataclass
class Plan:
    """One round's events (drawn from the round's seed)."""

    late: set = field(default_factory=set)
    """Groups submitted once a sample of the others has ``arrive_at`` response tokens."""
    arrive_at: int = 0
    victims: dict = field(default_factory=dict)
    """``{(group, index): n}``: aborted once it has n response tokens."""
    update: bool = False
    flush: bool = False
    pause_at: int = 0
    """Pause (retract), flush and continue once the first early request (streamed) has this many response tokens
    (0: no pause)."""
    arrived_mid_decode: bool = False
    """Set by ``_drive``: the late groups went in while the first early request was still decoding."""
    paused_in_place: bool | None = None
    """Set by ``_drive``: the pause held compressed requests in place (its flush was refused: requests hold KV), or
    retracted every request (False: the flush went through)."""


def draw_plan(rng: random.Random, jobs: list[Job], events: frozenset) -> Plan:
    plan = Plan()
    if "update" in events and rng.random() < 0.3:
        plan.update = True
    if "flush" in events and rng.random() < 0.3:
        plan.flush = True
    if "arrive" in events and len(jobs) >= 2 and rng.random() < 0.5:
        plan.late = set(rng.sample(range(1, len(jobs)), rng.randint(1, max(1, len(jobs) // 2))))
        plan.arrive_at = rng.randint(1, 8)
    if "abort" in events and rng.random() < 0.5:
        keys = [(g, i) for g, j in enumerate(jobs) for i in range(j.n)]
        for key in rng.sample(keys, min(len(keys), rng.randint(1, 3))):
            plan.victims[key] = rng.randint(1, jobs[key[0]].max_new_tokens - 2)
    if "pause" in events and rng.random() < 0.3:   # drawn last: the other events' draws stay what they were
        plan.pause_at = rng.randint(1, 20)
    return plan


def perturb_weights(engine, hf_model, seed: int) -> None:
    """New weights for engine and reference: the reference's parameters perturbed in place (tied ones once), then
    pushed to the engine as the next version the way the trainer pushes them (``update_weights``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hf_model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (PERTURB * float(p.std())))
    named = list(hf_model.state_dict().items())
    engine.update_weights([named[:5], named[5:]], version=engine.weight_version + 1)   # two buckets, as the learner


def streamed(requests: list, plan: Plan) -> set:
    """Keys of the requests ``_drive`` streams (to see their progress): the victims, and the first early request
    when some groups arrive late or a pause is planned. SGLang sends a streamed request's request-level custom info
    (the plugin's record) with its first chunk only, so a streamed sample is checked on its log-probs, not its
    record."""
    early = [r[0] for r in requests if r[0][0] not in plan.late]
    return set(plan.victims) | ({early[0]} if (plan.late or plan.pause_at) and early else set())


async def pause_flush_continue(tm, plan: Plan) -> None:
    """SGLang's retract pause, an immediate cache flush (what a driver does before a weight sync; SGLang answers it
    after it has paused), then ``continue_generation``. The flush goes through only if no request holds KV, i.e. the
    retract pause really retracted (``plan.paused_in_place`` records which)."""
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

    await tm.pause_generation(PauseGenerationReqInput(mode="retract"))
    flushed = await tm.flush_cache(timeout_s=0)
    plan.paused_in_place = not flushed.success
    await tm.continue_generation(ContinueGenerationReqInput())


async def _drive(tm, requests: list, plan: Plan) -> dict:
    """Submit ``requests`` (``(key, prompt, params, rid)``) on the engine's loop, all at once but the late groups:
    those once the first early request (streamed) has ``plan.arrive_at`` tokens (or every early one ended); the
    victims (streamed) aborted by rid once they have their token count; the pause once the first early request has
    ``plan.pause_at`` tokens. Returns ``{key: final output}``."""
    import asyncio

    from sglang.srt.managers.io_struct import GenerateReqInput

    started, results, stream = asyncio.Event(), {}, streamed(requests, plan)
    early = [r[0] for r in requests if r[0][0] not in plan.late]
    pauser = early[0] if plan.pause_at and early else None

    async def one(key, prompt, params, rid, late):
        if late:
            await started.wait()
        obj = GenerateReqInput(input_ids=prompt, sampling_params=params, return_logprob=True, stream=key in stream,
                               rid=rid)
        aborted, out = False, None
        async for out in tm.generate_request(obj, None):
            n = len(out["output_ids"])
            if plan.late and not late and n >= plan.arrive_at and not started.is_set() and key in stream:
                plan.arrived_mid_decode = not out["meta_info"].get("finish_reason")
                started.set()
            if key in plan.victims and not aborted and n >= plan.victims[key]:
                tm.abort_request(rid=rid)
                aborted = True
            if key == pauser and plan.paused_in_place is None and n >= plan.pause_at \
                    and not out["meta_info"].get("finish_reason"):
                await pause_flush_continue(tm, plan)
        results[key] = out

    first = [asyncio.ensure_future(one(*r, False)) for r in requests if r[0][0] not in plan.late]
    rest = [asyncio.ensure_future(one(*r, True)) for r in requests if r[0][0] in plan.late]
    if first:
        await asyncio.gather(*first)
    started.set()   # every early request ended before the mark (or there were none): the late ones go now
    await asyncio.gather(*rest)
    return results


def generate(engine, jobs: list[Job], seed: int, plan: Plan | None = None) -> tuple[dict, int, int]:
    """One batch of every job's samples (streamed, with the plan's arrivals and aborts); refused retractions are
    redrawn (plainly). Returns ``{(job, index): Sample}`` of the samples that finished (aborted ones are left
    out), the number of redraws and the number of aborted samples."""
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams

    plan = plan or Plan()
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=j.max_new_tokens, ignore_eos=True, seed=seed)
                for j in jobs]
    todo = [(g, i) for g, j in enumerate(jobs) for i in range(j.n)]
    done, redraws, aborted = {}, 0, 0
    tm = engine.client.engine.tokenizer_manager
    for attempt in range(MAX_DRAWS):
        # rids end with "." so that none is a prefix of another (SGLang's abort matches rid prefixes)
        requests = [((g, i), jobs[g].prompt,
                     engine._sampling(sampling[g], g, i, attempt, CompressionConfig(**jobs[g].compression)),
                     f"soak{seed}-{g}-{i}-{attempt}.") for g, i in todo]
        outs = engine.client._wait(_drive(tm, requests, plan))
        stream = streamed(requests, plan)
        retry = []
        for key in todo:
            out = outs[key]
            reason = out["meta_info"].get("finish_reason") or {}
            if engine._refused(out):
                retry.append(key)
            elif reason.get("type") == "abort" and key in plan.victims:
                aborted += 1
            else:
                g, i = key
                sample = engine._sample(out, jobs[g].prompt, jobs[g].prompt, g, i, sampling[g])
                sample.metadata.update(redraws=attempt, streamed=key in stream)
                done[key] = sample
        if not retry:
            return done, redraws, aborted
        redraws += len(retry)
        todo = retry
        plan = Plan()   # redraws run plainly
    raise RuntimeError(f"{len(todo)} request(s) refused after retractions {MAX_DRAWS} times")


def pause_kind(plan: Plan) -> str:
    return "in place" if plan.paused_in_place else "retracted"


def check_round(hf_model, jobs: list[Job], done: dict) -> tuple[float, float, list[str]]:
    """Every sample against ``teacher_forced`` with its group's compression: (max |delta log-prob|, max of
    |delta| / tolerance, failures)."""
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    worst, ratio, failures = 0.0, 0.0, []
    for g, job in enumerate(jobs):
        samples = [done[(g, i)] for i in range(job.n) if (g, i) in done]   # aborted samples are left out
        if not samples:
            continue
        ref = HFRolloutEngine(hf_model, compression=CompressionConfig(**job.compression), show_progress=False)
        reference = ref.teacher_forced([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        for s, r in zip(samples, reference):
            delta = (s.sampler_logprobs - r.sampler_logprobs).abs()
            d = float(delta.max())
            tol = numerics.hf_logprob_tolerance(hf_model, [s.prompt_ids], [s.response_ids])
            worst, ratio = max(worst, d), max(ratio, d / tol)
            got = (s.compression.events, s.compression.peak_kv_tokens, s.compression.kept_digest)
            want = (r.compression.events, r.compression.peak_kv_tokens, r.compression.kept_digest)
            if s.metadata["streamed"]:
                got = want   # a streamed request's record is its first chunk's (``streamed``)
            if not d <= tol or got != want:
                first = int((delta > tol).nonzero()[0, 0]) if not d <= tol else None
                failures.append(f"group {g} ({job.compression}) sample {s.index_in_group}: max |delta| {d:.3g} "
                                f"(first token over {tol:.3g}: {first}), record {got} vs reference {want}, "
                                f"retractions {s.metadata['retractions']}, redraws {s.metadata['redraws']}")
    return worst, ratio, failures


def run_round(engine, hf_model, jobs: list[Job], round_seed: int, plan: Plan | None = None) -> tuple:
    """One round on ``engine``: the plan's weight update and flush first, then the batch (``generate``), every
    finished sample checked against ``hf_model`` (``check_round``). Returns ``(done, redraws, aborted, max |delta|,
    max |delta| / tolerance, failures)``."""
    plan = plan or Plan()
    if plan.update:
        perturb_weights(engine, hf_model, round_seed)
    if plan.flush:
        engine.client.flush_cache()
    done, redraws, aborted = generate(engine, jobs, round_seed, plan)
    return (done, redraws, aborted, *check_round(hf_model, jobs, done))


def soak(*, seed: int, minutes: float = 0.0, max_rounds: int = 0, rounds_per_engine: int = 4,
         settings: Settings | None = None, fault: str = "", keep_going: bool = False,
         events: frozenset = frozenset(), triton_share: float = 0.0, log=print, tally: Tally | None = None) -> Tally:
    """Rounds until ``minutes`` pass (the round running then finishes) or ``max_rounds`` ran; ``settings`` fixes
    every engine's settings (default: drawn); ``events``: which of ``EVENTS`` rounds mix in (drawn per round from
    its seed; none by default). ``triton_share``: the share of engines on the triton backend (Triton's interpreter on
    CPU: slow, so keep it small). ``fault``: one of ``SOAK_FAULTS`` or the plugin's (``SPARSE_RL_KV_FAULT``). Stops
    at the first failing round unless ``keep_going``. ``tally``: counted into as rounds finish (the caller keeps the
    finished rounds' counts if the soak is interrupted)."""
    unknown = set(events) - set(EVENTS)
    if unknown:
        raise ValueError(f"soak: unknown events {sorted(unknown)}; choose from {', '.join(EVENTS)}")
    from sglang_ext.config import PLUGIN_FAULTS

    if fault not in ("", *SOAK_FAULTS, *PLUGIN_FAULTS):
        raise ValueError(f"soak: unknown fault '{fault}'; choose from {', '.join((*SOAK_FAULTS, *PLUGIN_FAULTS))}")
    if not 0.0 <= triton_share <= 1.0:
        raise ValueError(f"soak: triton_share must be in [0, 1], got {triton_share}")
    from sparse_rl_megatron.models.tiny import build_tiny_model, save_tiny_hf_checkpoint

    rng = random.Random(seed)
    backend_rng = random.Random(f"{seed}-backend")
    tally = Tally() if tally is None else tally
    deadline = time.monotonic() + 60 * minutes if minutes else None
    hf_model = build_tiny_model(seed=MODEL_SEED, init_std=INIT_STD)
    initial = {k: v.clone() for k, v in hf_model.state_dict().items()}   # what every new engine loads
    with tempfile.TemporaryDirectory(prefix="soak-plugin-") as tmp:
        model_dir = save_tiny_hf_checkpoint(Path(tmp) / "tiny-qwen2", seed=MODEL_SEED, init_std=INIT_STD)
        while True:
            engine_settings = with_backend(settings or draw_settings(rng), backend_rng, triton_share)
            engine = start_engine(model_dir, engine_settings, "" if fault in SOAK_FAULTS else fault)
            try:
                hf_model.load_state_dict(initial)
                if fault == "no_flush":
                    engine.client.flush_cache = lambda *args, **kwargs: None
                tally.engines += 1
                tally.triton_engines += engine_settings.backend == "triton"
                log(f"engine {tally.engines}: {engine_settings}")
                stems: list[list[int]] = []
                for _ in range(rounds_per_engine):
                    round_seed = rng.randrange(2 ** 31)
                    jobs = draw_workload(random.Random(round_seed), stems)
                    plan = draw_plan(random.Random(round_seed + 1), jobs, frozenset(events))
                    done, redraws, aborted, worst, ratio, failures = run_round(engine, hf_model, jobs, round_seed,
                                                                               plan)
                    tally.weight_updates += plan.update
                    tally.flushes += plan.flush
                    tally.pauses += plan.paused_in_place is not None
                    tally.pauses_in_place += bool(plan.paused_in_place)
                    samples = list(done.values())
                    tally.rounds += 1
                    tally.samples += len(samples)
                    tally.compressed_samples += sum(s.compression.events > 0 for s in samples)
                    tally.events += sum(s.compression.events for s in samples)
                    tally.retracted_samples += sum(s.metadata["retractions"] > 0 for s in samples)
                    tally.redraws += redraws
                    tally.aborted += aborted
                    tally.late_samples += sum(jobs[g].n for g in plan.late)
                    tally.arrivals_mid_decode += plan.arrived_mid_decode
                    tally.max_delta = max(tally.max_delta, worst)
                    tally.max_delta_over_bound = max(tally.max_delta_over_bound, ratio)
                    log(f"round {tally.rounds} (seed {round_seed}): {len(jobs)} groups, {len(samples)} samples, "
                        f"{sum(s.compression.events > 0 for s in samples)} compressed, "
                        f"{sum(s.metadata['retractions'] > 0 for s in samples)} retracted, {redraws} redraws, "
                        f"{aborted} aborted, {sum(jobs[g].n for g in plan.late)} late"
                        f"{', weights v' + str(engine.weight_version) if plan.update else ''}"
                        f"{', flushed' if plan.flush else ''}"
                        f"{'' if plan.paused_in_place is None else ', paused ' + pause_kind(plan)}, "
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
    p.add_argument("--fault", default="", help="test-only fault: the plugin's (stale_tables: no write hook; "
                   "abort_insert: an aborted compressed request goes into the radix tree) or no_flush (the soak's)")
    p.add_argument("--events", default=",".join(EVENTS),
                   help=f"events rounds mix in, comma-separated from {','.join(EVENTS)} ('' for none)")
    p.add_argument("--triton-share", type=float, default=0.0,
                   help="share of engines on the triton backend (Triton's interpreter on CPU: slow; e.g. 0.25)")
    p.add_argument("--keep-going", action="store_true", help="report every failing round instead of stopping")
    p.add_argument("--json", default="", help="also write the tally (and every failure's case) here")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from sglang_ext.config import PLUGIN_FAULTS

    for name, value, low in (("--minutes", args.minutes, 0), ("--rounds", args.rounds, 0),
                             ("--rounds-per-engine", args.rounds_per_engine, 1)):
        if value < low:
            p.error(f"{name} must be >= {low}, got {value}")
    if not 0.0 <= args.triton_share <= 1.0:
        p.error(f"--triton-share must be in [0, 1], got {args.triton_share}")
    if args.fault not in ("", *SOAK_FAULTS, *PLUGIN_FAULTS):
        p.error(f"--fault must be one of {', '.join((*SOAK_FAULTS, *PLUGIN_FAULTS))}, got '{args.fault}'")
    unknown = sorted({e for e in args.events.split(",") if e} - set(EVENTS))
    if unknown:
        p.error(f"--events: unknown {', '.join(unknown)}; choose from {', '.join(EVENTS)}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        p.error(f"--json: the folder {Path(args.json).resolve().parent} does not exist")
    start = time.monotonic()
    tally, stopped_by = Tally(), None
    previous = signal.signal(signal.SIGTERM, _raise_stop)  # a stop ends like Ctrl-C: engine shut down, rounds kept
    try:
        soak(seed=args.seed, minutes=args.minutes, max_rounds=args.rounds, fault=args.fault,
             settings=PRESSURED if args.pressured else None, rounds_per_engine=args.rounds_per_engine,
             keep_going=args.keep_going, events=frozenset(e for e in args.events.split(",") if e),
             triton_share=args.triton_share, tally=tally)
    except (KeyboardInterrupt, Stopped) as stop:
        stopped_by = "SIGTERM" if isinstance(stop, Stopped) else "Ctrl-C"
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary = {k: v for k, v in dataclasses.asdict(tally).items() if k != "failures"}
    summary.update(failed_samples=len(tally.failures), seed=args.seed, event_kinds=args.events,   # events: compressions
                   wall_s=round(time.monotonic() - start, 1),
                   first_failure=tally.failures[0] if tally.failures else None, stopped_by=stopped_by)
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "failures": tally.failures}, indent=1))
    if tally.failures:
        print(f"FAILED: {len(tally.failures)} sample(s) off the reference (tolerance: numerics.hf_logprob_tolerance)",
              file=sys.stderr)
        return 1
    if stopped_by:
        print(f"soak: stopped by {stopped_by} after {tally.rounds} finished round(s), 0 failures in them (the round "
              f"running then is not counted; its engine was shut down)", file=sys.stderr)
        return 130 if stopped_by == "Ctrl-C" else 143
    return 0


class Stopped(KeyboardInterrupt):
    """SIGTERM during the soak. A ``KeyboardInterrupt`` like Ctrl-C, so that asyncio re-raises it out of the engine's
    event loop (a plain exception raised in a task's step stays in that task, and the call would wait forever) and
    no ``except Exception`` on the way swallows it."""


def _raise_stop(signum, frame) -> None:
    raise Stopped()


if __name__ == "__main__":
    sys.exit(main())
