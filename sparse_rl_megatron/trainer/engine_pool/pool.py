"""Every rank's part in the run's rollout engines; ``rollout/layout.py`` says which engine each rank drives.

Phases, each collective (every rank calls it, engine or not):
- ``start``: each driving rank builds its engine(s) and its reward (a verification pool per engine rank);
- ``generate``: rank 0 shares the step's groups out over the engines (``rollout/work_split.py``, balanced by
  expected tokens; broadcast); each engine samples its groups under their global group ids (which seed them, so
  the batch does not depend on the number of engines) and its rank scores them; every rank gets every sample,
  in global group order;
- ``sync``: every rank iterates the learner's export (a collective that gives every rank every bucket); each
  driving rank hands the buckets to its engine(s), a colocated multi-GPU engine gets them per TP rank from the
  learner ranks on its GPUs (``colocated_weights.py``);
- ``probe``: every engine scores the probe sequence, checked against the learner's current and previous weights
  per engine (``weight_probe.probe_verdict``);
- ``on_engines``: any other per-engine work (evaluation shares, memory release and resume).
Engine calls run on the engine's own thread (``worker.py``) and are waited for until the phase deadline
(``phase_timeout_s`` less a margin to report); an engine that fails or hangs fails the phase on every rank
(``distributed.relay``) with one line naming the engine and its rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import torch

from sparse_rl_megatron.data.templates import render_prompt
from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.rollout.engine_protocol import ENGINE_MEMORY_PARTS
from sparse_rl_megatron.rollout.engine_registry import ENGINES
from sparse_rl_megatron.rollout.layout import RolloutLayout
from sparse_rl_megatron.rollout.repetition import repetition_metrics
from sparse_rl_megatron.rollout.work_split import group_cost, split_groups
from sparse_rl_megatron.trainer.engine_pool.colocated_weights import ColocatedPayloads
from sparse_rl_megatron.trainer.engine_pool.weight_probe import WeightSyncError, engine_logprobs, probe_verdict
from sparse_rl_megatron.trainer.engine_pool.worker import EngineHang, EngineWorker, Handoff
from sparse_rl_megatron.trainer.runtime import distributed as D
from sparse_rl_megatron.utils.errors import UserError

if TYPE_CHECKING:
    from sparse_rl_megatron.data.record import MathRecord
    from sparse_rl_megatron.rollout.engine_protocol import RolloutEngine, SamplingParams
    from sparse_rl_megatron.rollout.layout import EngineSlot, RolloutLayout
    from sparse_rl_megatron.learner.batch import SequenceBatch
    from sparse_rl_megatron.learner.learner import Learner
    from sparse_rl_megatron.rewards.reward import SampleReward
    from sparse_rl_megatron.rollout.sample import Sample
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.trainer.engine_pool.colocated_weights import ColocatedPayloads

MIB = 1024 * 1024
PHASE_REPORT_MARGIN_S = 60.0
"""An engine call is given up this long before the phase timeout (at most), so that its rank can still tell the
others (who wait up to the phase timeout) which engine hung..."""
PHASE_REPORT_FRACTION = 0.1
"""... or this fraction of the timeout, when that is shorter (short timeouts in tests)."""


class EngineError(RuntimeError):
    """A rollout engine failed or hung; the message names the engine, its rank and what it was doing."""


def engine_deadline(phase_timeout_s: float) -> float:
    """Seconds an engine call may take: the phase timeout less the margin to report a hang."""
    return phase_timeout_s - min(PHASE_REPORT_MARGIN_S, PHASE_REPORT_FRACTION * phase_timeout_s)


@dataclass
class LocalEngine:
    """One engine this rank drives."""

    slot: "EngineSlot"
    engine: "RolloutEngine"
    worker: EngineWorker
    label: str


@dataclass
class _SegmentRequest:
    """One request of a partial-rollout segment: a new sample (``record`` its problem) or the continuation of the
    carried sample ``continues`` (its response so far the ``prefix``)."""

    prompt: "str | list[int]"
    prefix: list[int]
    group_id: int
    index: int
    cap: int
    """Most new tokens this call."""
    record: "MathRecord | None" = None
    continues: "Sample | None" = None

    def joined(self, part: "Sample", tokenizer) -> "Sample":
        """The sample this request's output ``part`` makes: the new sample under its group and index, or the carried
        one extended by it."""
        from sparse_rl_megatron.rollout.continuation import extend

        if self.continues is not None:
            return extend(self.continues, part, tokenizer)
        part.group_id, part.index_in_group = self.group_id, self.index
        part.metadata.update(self.record.metadata())
        return part


@dataclass
class EnginePool:
    """This rank's engines and reward, and the collective phases over all engines (module docstring)."""

    layout: "RolloutLayout"
    name: str
    """``rollout.engine``."""
    deadline_s: float
    local: list[LocalEngine] = field(default_factory=list)
    reward: "SampleReward | None" = None
    """Scores this rank's engines' samples (None on a rank that drives none)."""
    payloads: "ColocatedPayloads | None" = None
    """``ColocatedPayloads`` when colocated engines load per-TP-rank payloads (this rank serializes its copy)."""
    probed: dict[int, torch.Tensor] = field(default_factory=dict)
    """The learner's log-probs of the probe's response tokens at the versions last probed (the latest one is the
    previous version of the next probe: a stale engine is closer to it than to the new version)."""

    # ---------------------------------------------------------------------------------------------- start
    @classmethod
    def start(cls, cfg: "TrainConfig", layout: "RolloutLayout", hf_dir: str, stack: contextlib.ExitStack,
              make_reward: "Callable[[], ContextManager[SampleReward]]") -> "EnginePool":
        """Build this rank's engines (and its reward, a context manager entered on ``stack``). Collective; a
        rank that fails to start its engine fails every rank."""
        rank = D.rank()
        pool = cls(layout, cfg.rollout.engine, engine_deadline(cfg.phase_timeout_s))
        spec = ENGINES.get(cfg.rollout.engine)
        stack.callback(pool.close)
        error, label = None, f"the reward of rank {rank}"
        try:
            for slot in layout.slots_of(rank):
                label = pool.label_of(slot)
                engine = spec.make(cfg.rollout.engine_build(hf_dir, show_progress=cfg.log.progress and rank == 0,
                                                             slot=slot, run_seed=cfg.seed,
                                                             record_routing=cfg.learner.moe.routing_replay))
                stack.callback(engine.shutdown)
                pool.local.append(LocalEngine(slot, engine, EngineWorker(label), label))
            if pool.local:
                label = f"the reward of rank {rank}"
                pool.reward = stack.enter_context(make_reward())
        except UserError as err:
            error = err
        except Exception as err:  # named, then handed to every rank
            error = EngineError(f"{label} failed to start: {type(err).__name__}: {err}")
            error.__cause__ = err
        D.relay(error, EngineError)
        if not layout.servers and spec.takes_payloads(cfg.rollout.engine_build(hf_dir, slot=layout.slots[0])):
            pool.payloads = ColocatedPayloads(layout, rank, cfg.phase_timeout_s)
        return pool

    @classmethod
    def single(cls, engine: "RolloutEngine | None", reward: "SampleReward | None", name: str,
               deadline_s: float = 4 * 3600.0) -> "EnginePool":
        """One engine on rank 0 (``engine`` there, None elsewhere) serving every rank: the form of callers that
        build their engine themselves (``sparse-rl mismatch``, the experiment's control). A context manager: ``with
        EnginePool.single(...) as pool:`` closes its engine thread (not the engine) at the end."""
        world = D.world_size()
        layout = RolloutLayout.build(engine=name, world=world, ranks_per_node=world, gpus_per_engine=world, groups=0)
        pool = cls(layout, name, deadline_s, reward=reward)
        if D.is_main():
            slot = layout.slots[0]
            pool.local.append(LocalEngine(slot, engine, EngineWorker(pool.label_of(slot)), pool.label_of(slot)))
        return pool

    def label_of(self, slot: "EngineSlot") -> str:
        where = f" ({slot.url})" if slot.url else ""
        return f"rollout engine '{self.name}' #{slot.index} on rank {slot.rank}{where}"

    def close(self) -> None:
        for local in self.local:
            local.worker.close()

    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -------------------------------------------------------------------------------------- per engine
    def on_engines(self, work: Callable[["RolloutEngine", "EngineSlot"], Any], what: str) -> list[Any]:
        """``work(engine, slot)`` for every engine of the run, each on its rank's engine thread, waited for until the
        phase deadline; returns every engine's result, in engine order, on every rank. Collective. An engine that
        fails or hangs raises ``EngineError`` on every rank: ``<engine> on rank <r> failed while <what>: ...``."""
        deadline = time.monotonic() + self.deadline_s
        pending, error = [], None
        for local in self.local:
            future, failed = self._submit(local, lambda e=local.engine, s=local.slot: work(e, s), what)
            error = error or failed
            if future is not None:
                pending.append((local, future))
        results: dict[int, Any] = {}
        for local, future in pending:
            result, failed = self._outcome(local, future, what, deadline)
            error = error or failed
            if failed is None:
                results[local.slot.index] = result
        D.relay(error, EngineError)
        merged: dict[int, Any] = {}
        for part in D.gather_objects(results):
            merged.update(part)
        return [merged.get(k) for k in range(self.layout.num_engines)]

    @staticmethod
    def _submit(local: LocalEngine, call: Callable[[], Any], what: str) -> tuple[Any, Exception | None]:
        """``call`` queued on ``local``'s engine thread: ``(future, None)``, or ``(None, EngineError)`` when that
        thread is still stuck in an earlier call."""
        try:
            return local.worker.submit(call, what), None
        except EngineHang as err:
            return None, EngineError(f"{local.label} cannot take part in {what}: {err}")

    def _outcome(self, local: LocalEngine, future, what: str, deadline: float) -> tuple[Any, Exception | None]:
        """``(result, None)`` of a submitted call once it is done, or ``(None, error)``: an ``EngineError`` naming
        the engine when it failed or did not finish by ``deadline``; a ``UserError`` as it is."""
        try:
            return local.worker.wait(future, what, deadline), None
        except EngineHang:
            return None, EngineError(f"{local.label} did not finish {what} within {self.deadline_s:g} s (the phase "
                                     "timeout, phase_timeout_s, less the margin to report it): the engine hangs")
        except UserError as err:
            return None, err
        except Exception as err:
            error = EngineError(f"{local.label} failed while {what}: {type(err).__name__}: {err}")
            error.__cause__ = err
            return None, error

    def release_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        """Every engine frees ``parts`` of its memory (``rollout.engine_protocol.ENGINE_MEMORY_PARTS``) while the learner uses
        the device (SGLang with ``memory_saver`` on CUDA)."""
        self.on_engines(lambda engine, slot: engine.release_memory(parts),
                        f"releasing its memory ({', '.join(parts)}) for the learner")

    def resume_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        """Every engine takes ``parts`` of its memory back (``rollout.engine_protocol.ENGINE_MEMORY_PARTS``)."""
        self.on_engines(lambda engine, slot: engine.resume_memory(parts),
                        f"taking its memory back ({', '.join(parts)})")

    # ---------------------------------------------------------------------------------------- generate
    def _rendered(self, records: "list[MathRecord]", template: str) -> tuple[list[str], list[int]]:
        """Rank 0: ``records``' prompts under ``template`` and their token counts (characters without a tokenizer),
        what the groups are shared out by."""
        tokenizer = self.local[0].engine.tokenizer
        prompts = [render_prompt(template, r.prompt, tokenizer) for r in records]
        lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) if tokenizer is not None else len(p)
                   for p in prompts]
        return prompts, lengths

    def generate(self, records: "list[MathRecord] | None", template: str, n: int, sampling: "SamplingParams",
                 step: int, budget: int | None = None) -> tuple[list["Sample"], dict[str, float]]:
        """``n`` scored samples per record of rank 0's ``records`` (None elsewhere), from every engine; the same
        group-major list and metrics on every rank. ``budget``: this step's KV budget B instead of the engines' own
        (the adaptive budget's; each engine's compression otherwise as built). Collective."""
        t0 = time.perf_counter()
        plan = None
        if D.is_main():
            prompts, lengths = self._rendered(records, template)
            shares = split_groups([group_cost(x, n, sampling.max_new_tokens) for x in lengths], self.layout.num_engines)
            plan = (records, prompts, shares)
        records, prompts, shares = D.broadcast_from_main(plan)

        def work(engine, slot):
            share = shares[slot.index]
            if not share:
                return [], 0.0, 0.0
            t_gen = time.perf_counter()
            samples = engine.generate([prompts[g] for g in share], n, sampling, group_ids=share,
                                      budgets=None if budget is None else [budget] * len(share))
            t_reward = time.perf_counter()
            if sorted((s.group_id, s.index_in_group) for s in samples) != [(g, i) for g in share for i in range(n)]:
                raise RuntimeError(f"it returned {len(samples)} samples, not the n={n} samples of each of its "
                                   f"{len(share)} groups")
            for s in samples:
                s.metadata.update(records[s.group_id].metadata())
            self.reward.score_samples(samples)
            return samples, t_reward - t_gen, time.perf_counter() - t_reward

        shards = self.on_engines(work, f"generating step {step}")
        samples = sorted((s for part, _, _ in shards for s in part), key=lambda s: (s.group_id, s.index_in_group))
        gen_s = [g for part, g, _ in shards if part]
        metrics = rollout_metrics(samples)
        metrics.update(repetition_metrics(samples))
        metrics.update({MN.TIME_ROLLOUT_S: max(gen_s), MN.TIME_ROLLOUT_ENGINE_MIN_S: min(gen_s),
                        MN.TIME_REWARD_S: max(r for _, _, r in shards),
                        MN.TIME_ROLLOUT_PHASE_S: time.perf_counter() - t0,
                        MN.THROUGHPUT_ROLLOUT_TOKENS_PER_S: sum(s.response_length for s in samples) / max(max(gen_s),
                                                                                                       1e-9)})
        return samples, metrics

    def generate_segment(self, records: "list[MathRecord] | None", group_ids: Sequence[int],
                         carried: Sequence["Sample"], template: str, n: int, sampling: "SamplingParams",
                         segment_tokens: int, seed: int, step: int, budget: int | None = None
                         ) -> tuple[list["Sample"], dict[str, float]]:
        """One segment of a partial rollout (``trainer/partial_rollouts.py``): ``n`` samples for each of rank 0's
        ``records`` (None elsewhere) under ``group_ids``, and every ``carried`` sample (the same list on every rank)
        continued; each response gains at most ``segment_tokens`` tokens, and at most ``sampling.max_new_tokens`` in
        all. Returns every sample (new, and carried ones extended: ``continuation.extend``), those finished scored
        where they were sampled, on every rank in (group, index) order, and the phase's times.

        Each engine gets its share as one ``generate`` call of single requests (a new sample is a request with an
        empty prefix, beside the continued ones), so the engine decodes them all together; a response near the
        token limit, whose cap is smaller, goes in a call of its own cap. Every request is seeded by ``seed`` and
        ``group_id * n + index``. Collective."""
        from sparse_rl_megatron.rollout.continuation import is_finished

        t0 = time.perf_counter()
        limit = sampling.max_new_tokens
        plan = None
        if D.is_main():
            prompts, lengths = self._rendered(records, template)
            costs = [group_cost(x, n, min(segment_tokens, limit)) for x in lengths]
            costs += [group_cost(len(c.prompt_ids) + c.response_length, 1, segment_tokens) for c in carried]
            plan = (records, prompts, split_groups(costs, self.layout.num_engines))
        records, prompts, shares = D.broadcast_from_main(plan)
        fresh = len(prompts)

        def work(engine, slot):
            share = shares[slot.index]
            t_gen, out = time.perf_counter(), []
            requests = [_SegmentRequest(prompts[j], [], group_ids[j], i, min(segment_tokens, limit), records[j])
                        for j in share if j < fresh for i in range(n)]
            requests += [_SegmentRequest(c.prompt_ids, c.response_ids, c.group_id, c.index_in_group,
                                         min(segment_tokens, limit - c.response_length), continues=c)
                         for c in (carried[j - fresh] for j in share if j >= fresh)]
            for cap in sorted({r.cap for r in requests}):
                batch = [r for r in requests if r.cap == cap]
                got = engine.generate([r.prompt for r in batch], 1, dataclasses.replace(
                    sampling, seed=seed, max_new_tokens=cap), group_ids=[r.group_id * n + r.index for r in batch],
                    budgets=None if budget is None else [budget] * len(batch),
                    prefixes=[r.prefix for r in batch] if any(r.prefix for r in batch) else None)
                out += [r.joined(part, engine.tokenizer) for r, part in zip(batch, got)]
            t_reward = time.perf_counter()
            finished = [s for s in out if is_finished(s, limit)]
            if finished:
                self.reward.score_samples(finished)
            return out, t_reward - t_gen, time.perf_counter() - t_reward

        shards = self.on_engines(work, f"generating step {step} (a partial-rollout segment)")
        samples = sorted((s for part, _, _ in shards for s in part), key=lambda s: (s.group_id, s.index_in_group))
        gen_s = [g for part, g, _ in shards if part] or [0.0]
        return samples, {MN.TIME_ROLLOUT_S: max(gen_s), MN.TIME_REWARD_S: max(r for _, _, r in shards),
                         MN.TIME_ROLLOUT_PHASE_S: time.perf_counter() - t0}

    # ------------------------------------------------------------------------------------- weight sync
    def sync(self, learner: "Learner", version: int, bucket_mb: int) -> dict[str, float]:
        """Push the learner's weights to every engine as ``version``. Collective: every rank iterates the export;
        each driving rank hands every bucket to its engine(s), one at a time."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.deadline_s
        what = f"loading the weights of version {version}"
        feeds, error = [], None
        payload = self.payloads is not None
        for local in self.local:
            handoff = Handoff()
            load = local.engine.update_weights_from_payloads if payload else local.engine.update_weights
            future, failed = self._submit(local, lambda h=handoff, f=load: f(h.items(), version), what)
            error = error or failed
            if future is not None:
                feeds.append((local, handoff, future))
        reading = [True] * len(feeds)  # False once an engine stopped reading (done, failed or hung)
        buckets = nbytes = 0
        for bucket in learner.export_weights(bucket_bytes=bucket_mb * MIB):
            buckets += 1
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            item = self.payloads.gather(bucket) if payload else bucket
            for i, (_, handoff, future) in enumerate(feeds):
                reading[i] = reading[i] and handoff.give(item, future, deadline)
            if payload:
                self.payloads.release()  # the engine has this bucket: its other ranks may drop their copies
            del bucket, item
        for (local, handoff, future), still in zip(feeds, reading):
            if still:
                handoff.close(future, deadline)
            error = error or self._outcome(local, future, what, deadline)[1]
        D.relay(error, EngineError)
        return {MN.SYNC_SECONDS: time.perf_counter() - t0, MN.SYNC_BUCKETS: float(buckets), MN.SYNC_MIB: nbytes / MIB}

    # ------------------------------------------------------------------------------------------- probe
    def probe(self, learner_lp: torch.Tensor, probe: "SequenceBatch", tolerance: float,
              version: int) -> dict[str, float]:
        """Every engine's dense log-probs of ``probe`` against the learner's (``learner_lp``, ``[1, T]`` from
        ``Learner.logprobs(probe)``: taken before a colocated learner goes to sleep) at ``version`` and, when this
        pool probed an earlier version, the latest such (``weight_probe.probe_verdict``). Collective; raises
        ``WeightSyncError`` (one line) on every rank naming the first engine (and rank) that is stale or garbled."""
        mask = probe.response_mask()
        current = learner_lp[mask]
        older = [v for v in self.probed if v < version]
        previous = (max(older), self.probed[max(older)]) if older else None

        def work(engine, slot):
            if engine.weight_version != version:
                return ("stale", engine.weight_version)
            return ("scored", engine_logprobs(engine, probe)[mask])

        results = self.on_engines(work, f"scoring the weight-sync probe (version {version})")
        bad, verdicts = [], []
        for slot, (kind, value) in zip(self.layout.slots, results):
            label = self.label_of(slot)
            if kind == "stale":
                bad.append(f"{label} serves weight version {value}, not {version}")
                continue
            verdict = probe_verdict(value, current, tolerance, version, previous)
            verdicts.append(verdict)
            if verdict.problem is not None:
                bad.append(f"{label} does not serve the learner's weights (version {version}): {verdict.problem}")
        if bad:
            error = WeightSyncError(bad[0] + (f" (and {len(bad) - 1} more engine(s))" if len(bad) > 1 else ""))
            error.relayed_from_main = not D.is_main()  # every rank found it; rank 0 prints it
            raise error
        self.probed = {version: current}  # and the previous version's, for a probe of this version again
        if previous is not None:
            self.probed[previous[0]] = previous[1]
        return {MN.SYNC_PROBE_MEAN_ABS_DIFF: max(v.mean_abs_diff for v in verdicts),
                MN.SYNC_PROBE_MAX_ABS_DIFF: max(v.max_abs_diff for v in verdicts)}


def sync_weights(learner, engine, version: int, bucket_mb: int) -> dict[str, float]:
    """Push the learner's weights to one engine on rank 0 (``engine``; None elsewhere) as ``version``. Collective.
    (A run's engines: ``EnginePool.sync``.)"""
    with EnginePool.single(engine, None, "engine") as pool:
        return pool.sync(learner, version, bucket_mb)


def probe_weights(learner, engine, probe: "SequenceBatch", tolerance: float, engine_name: str,
                  version: int) -> dict[str, float]:
    """Compare the dense log-probs of one engine on rank 0 (``engine``; None elsewhere) with the learner's.
    Collective; raises ``WeightSyncError`` on every rank past ``tolerance``. (A run's engines: ``EnginePool.probe``.)"""
    with EnginePool.single(engine, None, engine_name) as pool:
        return pool.probe(learner.logprobs(probe), probe, tolerance, version)


def rollout_metrics(samples: Sequence["Sample"]) -> dict[str, float]:
    """Rewards, lengths, compression and KV memory of a batch of samples (provenance included)."""
    count = len(samples)
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    lengths = torch.tensor([float(s.response_length) for s in samples])
    dense_kv = torch.tensor([float(len(s.prompt_ids) + s.response_length) for s in samples])
    peak_kv = torch.tensor([float(s.compression.peak_kv_tokens) for s in samples])
    groups: dict[int, list[float]] = {}
    for s, r in zip(samples, rewards.tolist()):
        groups.setdefault(s.group_id, []).append(r)
    budgets = [s.compression.budget for s in samples if s.compression.budget is not None]
    sampled = {MN.ROLLOUT_BUDGET_SAMPLED_MEAN: sum(budgets) / len(budgets)} if budgets else {}
    return {
        **sampled,  # the budget B in the samples' provenance (compressed samples only)
        MN.ROLLOUT_REWARD_MEAN: float(rewards.mean()),
        MN.ROLLOUT_GROUPS_WITH_SIGNAL_FRAC: sum(max(g) > min(g) for g in groups.values()) / len(groups),
        MN.ROLLOUT_RESPONSE_LEN_MEAN: float(lengths.mean()),
        MN.ROLLOUT_RESPONSE_LEN_MAX: float(lengths.max()),
        MN.ROLLOUT_TRUNCATED_FRAC: sum(s.finish_reason == "length" for s in samples) / count,
        MN.ROLLOUT_COMPRESSION_EVENTS_MEAN: sum(s.compression.events for s in samples) / count,
        MN.ROLLOUT_KV_TOKENS_PEAK_MEAN: float(peak_kv.mean()),
        MN.ROLLOUT_KV_TOKENS_DENSE_MEAN: float(dense_kv.mean()),
        MN.ROLLOUT_KV_RETAINED_FRAC: float((peak_kv / dense_kv).mean()),
        MN.ROLLOUT_WEIGHT_VERSION: float(min(s.weight_version for s in samples)),
        # SGLang under KV pressure: samples retracted (re-prefilled: dense, or before their first compression) and
        # redrawn (refused after a compression; admission keeps compressed requests from being retracted, so 0)
        MN.ROLLOUT_RETRACTED_FRAC: sum(s.metadata.get("retractions", 0) > 0 for s in samples) / count,
        MN.ROLLOUT_REDRAWN_FRAC: sum(s.metadata.get("redraws", 0) > 0 for s in samples) / count,
        MN.ROLLOUT_RETRACTIONS: float(sum(s.metadata.get("retractions", 0) for s in samples)),
        MN.ROLLOUT_REDRAWS: float(sum(s.metadata.get("redraws", 0) for s in samples)),
    }
