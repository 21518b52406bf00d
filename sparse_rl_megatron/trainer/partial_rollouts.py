"""Partial rollouts (``rollout.partial``): a step trains on the first whole GRPO groups that finish, the rest carry on.

Per rollout step k (the engines serve weight version k - 1, the learner's current weights):
  1. groups holding a token more than ``max_staleness`` versions old are dropped (counted);
  2. new groups (``samples_per_prompt`` requests each) top the groups in flight up to ``prompts_per_step +
     extra_groups`` (over-provisioning);
  3. segments of at most ``segment_tokens`` new tokens per response (``EnginePool.generate_segment``: new and
     continued requests in one engine call, decoded together) run until
     ``prompts_per_step`` groups have all their samples finished, or none runs; a call continues a carried response by
     re-prefilling prompt + response so far under the engine's current weights (``generate(..., prefixes=...)``);
  4. the oldest ``prompts_per_step`` finished groups are the step's batch; every other sample stays in flight
     (finished ones wait with their reward, running ones continue at step k + 1 under version k).
Every token keeps the weight version it was sampled under (``Sample.token_versions``) and its sampler log-prob, so
the correction's one ratio pi_old / pi_sampler covers policy lag and sparsity together (``docs/algorithm.md``,
"Partial rollouts"). The samples in flight are saved with the checkpoint (``TrainerState.partial``): a resumed run
continues them exactly as the uninterrupted run would.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.rollout.continuation import is_finished
from sparse_rl_megatron.rollout.repetition import repetition_metrics
from sparse_rl_megatron.rollout.sample import Sample
from sparse_rl_megatron.trainer.engine_pool.pool import rollout_metrics

if TYPE_CHECKING:
    from sparse_rl_megatron.algo import PreparedBatch
    from sparse_rl_megatron.data.record import MathRecord
    from sparse_rl_megatron.rollout.config import PartialRolloutConfig
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.trainer.engine_pool.pool import EnginePool

LAG_BUCKETS = 2
"""Token shares are reported for lag 0, 1, ..., ``LAG_BUCKETS - 1`` and ``LAG_BUCKETS`` or more."""


def segment_seed(seed: int, step: int, segment: int) -> int:
    """The sampler seed of one segment of a partial rollout (its requests are told apart by group and index): a pure
    function, so a resumed run draws what the uninterrupted run would."""
    digest = hashlib.blake2b(f"partial/{seed}/{step}/{segment}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def token_lags(samples: list[Sample], version: int) -> list[list[int]]:
    """``[B][R]`` each response token's lag at training time: ``version`` (the learner's) less the token's."""
    return [[version - v for v in s.versions()] for s in samples]


@dataclass
class PartialRollouts:
    """The groups in flight between steps and the step procedure of the module docstring."""

    config: "PartialRolloutConfig"
    prompts_per_step: int
    n: int
    """GRPO group size (``rollout.samples_per_prompt``)."""
    in_flight: list[Sample] = field(default_factory=list)
    """Every sample of every group in flight, finished (scored, waiting for its group) or not; (group, index) order."""
    next_group: int = 0
    """The group id the next new group gets (ids grow over the run; the batch's GRPO groups are these ids)."""

    # ---------------------------------------------------------------------------------------------- step
    def step(self, pool: "EnginePool", take: Callable[[int], "list[MathRecord] | None"], template: str,
             sampling: "SamplingParams", seed: int, step: int, budget: int | None = None
             ) -> tuple[list[Sample], dict[str, float]]:
        """Step ``step``'s batch (``prompts_per_step`` whole groups, group-major) and its rollout metrics. ``take(k)``:
        rank 0's next k problems (None elsewhere). Collective (every rank holds the same samples in flight)."""
        limit, version = sampling.max_new_tokens, step - 1
        dropped = self._drop_stale(version)
        want = self.prompts_per_step + self.config.extra_groups
        fresh = max(0, want - len(self._groups()))
        gids = list(range(self.next_group, self.next_group + fresh))
        self.next_group += fresh
        records = take(fresh)
        before = {(s.group_id, s.index_in_group): s.response_length for s in self.in_flight}
        times: dict[str, float] = {}
        segments = 0
        while True:
            running = [s for s in self.in_flight if not is_finished(s, limit)]
            if not running and not gids:
                break
            got, seg_times = pool.generate_segment(records, gids, running, template, self.n, sampling,
                                                   self.config.segment_tokens, segment_seed(seed, step, segments),
                                                   step, budget)
            for key, value in seg_times.items():
                times[key] = times.get(key, 0.0) + value
            done = [s for s in self.in_flight if is_finished(s, limit)]
            self.in_flight = sorted(done + got, key=lambda s: (s.group_id, s.index_in_group))
            records, gids = ([] if records is not None else None), []
            segments += 1
            if len(self._finished_groups(limit)) >= self.prompts_per_step:
                break
        batch_groups = set(self._finished_groups(limit)[:self.prompts_per_step])
        batch = [s for s in self.in_flight if s.group_id in batch_groups]
        new_tokens = sum(s.response_length - before.get((s.group_id, s.index_in_group), 0) for s in self.in_flight)
        self.in_flight = [s for s in self.in_flight if s.group_id not in batch_groups]
        metrics = {**rollout_metrics(batch), **repetition_metrics(batch), **times,
                   **self._metrics(batch, version, limit, segments, fresh, dropped)}
        metrics[MN.THROUGHPUT_ROLLOUT_TOKENS_PER_S] = new_tokens / max(times.get(MN.TIME_ROLLOUT_S, 0.0), 1e-9)
        return batch, metrics

    def _groups(self) -> list[int]:
        return sorted({s.group_id for s in self.in_flight})

    def _finished_groups(self, limit: int) -> list[int]:
        """Group ids whose every sample is finished, oldest first."""
        running = {s.group_id for s in self.in_flight if not is_finished(s, limit)}
        return [g for g in self._groups() if g not in running]

    def _drop_stale(self, version: int) -> tuple[int, int]:
        """Drop the groups holding a token older than ``max_staleness`` versions at ``version``: (groups, samples)."""
        stale = {s.group_id for s in self.in_flight
                 if s.response_length and version - min(s.versions()) > self.config.max_staleness}
        kept = [s for s in self.in_flight if s.group_id not in stale]
        count = len(self.in_flight) - len(kept)
        self.in_flight = kept
        return len(stale), count

    def _metrics(self, batch: list[Sample], version: int, limit: int, segments: int, fresh: int,
                 dropped: tuple[int, int]) -> dict[str, float]:
        lags = torch.tensor([lag for row in token_lags(batch, version) for lag in row], dtype=torch.float32)
        out = {MN.PARTIAL_SEGMENTS: float(segments), MN.PARTIAL_NEW_GROUPS: float(fresh),
               MN.PARTIAL_DROPPED_GROUPS: float(dropped[0]), MN.PARTIAL_DROPPED_SAMPLES: float(dropped[1]),
               MN.PARTIAL_CARRIED_REQUESTS: float(sum(not is_finished(s, limit) for s in self.in_flight)),
               MN.PARTIAL_WAITING_GROUPS: float(len(self._finished_groups(limit))),
               MN.PARTIAL_CONTINUED_FRAC: sum(s.metadata.get("segments", 1) > 1 for s in batch) / max(len(batch), 1),
               MN.PARTIAL_STALENESS_MEAN: float(lags.mean()) if lags.numel() else 0.0,
               MN.PARTIAL_STALENESS_MAX: float(lags.max()) if lags.numel() else 0.0}
        for lag in range(LAG_BUCKETS + 1):
            share = (lags >= lag) if lag == LAG_BUCKETS else (lags == lag)
            out[MN.partial_lag_share(lag, lag == LAG_BUCKETS)] = float(share.float().mean()) if lags.numel() else 0.0
        return out

    # ----------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON): the samples in flight and the next group id."""
        return {"next_group": self.next_group, "in_flight": [s.to_dict() for s in self.in_flight]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group = int(state["next_group"])
        self.in_flight = [Sample.from_dict(s) for s in state["in_flight"]]


def lag_split_metrics(prepared: "PreparedBatch", samples: list[Sample], version: int) -> dict[str, float]:
    """The rho tail split into policy lag and compression: mean and 99th percentile of |log rho| over the trained
    batch's response tokens sampled under the learner's weights (lag 0: sparsity alone) and under older ones."""
    mask = prepared.response_mask
    lags = torch.zeros(mask.shape, dtype=torch.long)
    for row, lag in enumerate(token_lags(samples, version)):
        lags[row, :len(lag)] = torch.tensor(lag, dtype=torch.long)
    out = {}
    for name, where in (("lag0", mask & (lags == 0)), ("lagged", mask & (lags > 0))):
        values = prepared.log_rho[where].abs().float()
        if values.numel():
            out[MN.partial_abs_log_rho(name, "mean")] = float(values.mean())
            out[MN.partial_abs_log_rho(name, "p99")] = float(torch.quantile(values, 0.99))
    return out
