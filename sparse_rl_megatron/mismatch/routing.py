"""What routing adds to the rho tail of a mixture of experts, per compressed row of ``sparse-rl mismatch``.

A compressed cache changes the hidden states of every later token, so a MoE sampler routes some tokens to other
experts than the dense recompute does: its log-probs then differ by more than the attention's own error. This
splits the two. On the HF reference engine (``HFRolloutEngine.teacher_forced``, the oracle: it replays a sample
through the same compression schedule and keeps the experts every fed token went to):

- dense replay: the experts the dense model picks for each response token (per layer);
- compressed replay: the sampler's own experts (replaying sampling reproduces it);
- compressed replay *routed as the dense model routes*: the attention's mismatch alone.

Statistics (``moe/*``; rho against the learner's dense recompute, as the correction sees it):

==================================  ============================================================================
``moe/routing_flip_frac``           (fed response token, layer) pairs whose top-k set differs compressed vs dense
``moe/token_flip_frac``             fed response tokens with a different top-k set in at least one layer
``moe/contaminated_frac_dense_routing``  ``sparse/contaminated_frac`` with the sampler routed as the dense model
``moe/routing_contamination``       ``sparse/contaminated_frac`` minus the above: the share routing adds
``moe/rho_p1_dense_routing``, ``moe/rho_min_dense_routing``  the rho tail without the routing change
``moe/would_veto_frac_dense_routing``  ``sparse/would_veto_frac`` likewise
``moe/replay_max_abs_diff``         largest |log-prob| gap between the sampler and its compressed replay (0 for the
                                    HF engine, which replays itself; SGLang's agreement with the oracle otherwise)
==================================  ============================================================================

With the SGLang engine the replays run on the HF oracle (the same weights): the split is the oracle's, which the
SGLang engine is checked against (``tests/sglang``).

Every row, dense included, when the engine recorded the sampler's routes (the HF engine; ``replay_split``): the
engine against the learner, i.e. what precision and kernels add (the sampler bf16, the learner bf16: near-tied top-k
choices break differently), and what routing replay (``learner.moe.routing_replay``, R3) does to the tail:

==================================  ============================================================================
``moe/learner_flip_frac``           (fed response token, layer) pairs whose top-k set differs between the sampler's
                                    recorded routes and the learner's own dense routing (as ``routing_flip_frac``)
``moe/learner_token_flip_frac``     fed response tokens with a different top-k set in at least one layer
``moe/learner_prompt_flip_frac``    (prompt token, layer) pairs likewise (prefill: never compressed)
``moe/contaminated_frac_replay``    ``sparse/contaminated_frac`` with pi_old recomputed on the sampler's routes
``moe/rho_p1_replay``, ``moe/rho_min_replay``, ``moe/log_rho_abs_max_replay``  the rho tail with replay
==================================  ============================================================================
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from sparse_rl_megatron.algo.diagnostics import CONTAMINATION_THRESHOLD, would_veto
from sparse_rl_megatron.algo.ratio import sparsity_log_ratio
from sparse_rl_megatron.algo.rejection import sequence_veto
from sparse_rl_megatron.algo.rho_stats import rho_summary
from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.observability import metric_names as MN

if TYPE_CHECKING:
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
    from sparse_rl_megatron.rollout.sample import Sample

REPLAY_KEYS = (MN.MOE_LEARNER_FLIP_FRAC, MN.MOE_LEARNER_TOKEN_FLIP_FRAC, MN.MOE_LEARNER_PROMPT_FLIP_FRAC,
               MN.MOE_CONTAMINATED_FRAC_REPLAY, MN.MOE_RHO_P1_REPLAY, MN.MOE_RHO_MIN_REPLAY,
               MN.MOE_LOG_RHO_ABS_MAX_REPLAY)
ROUTING_KEYS = (MN.MOE_ROUTING_FLIP_FRAC, MN.MOE_TOKEN_FLIP_FRAC, MN.MOE_CONTAMINATED_FRAC_DENSE_ROUTING,
                MN.MOE_ROUTING_CONTAMINATION, MN.MOE_RHO_P1_DENSE_ROUTING, MN.MOE_RHO_MIN_DENSE_ROUTING,
                MN.MOE_WOULD_VETO_FRAC_DENSE_ROUTING, MN.MOE_REPLAY_MAX_ABS_DIFF)


def routing_flips(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[T, layers]`` bool: the top-k expert sets of ``a`` and ``b`` (``[T, layers, k]``) differ."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def routing_split(oracle: "HFRolloutEngine", samples: Sequence["Sample"], compression: "CompressionConfig",
                  old_log_probs: torch.Tensor, response_mask: torch.Tensor, contaminated_frac: float,
                  veto_threshold: float | None) -> dict[str, float]:
    """The statistics of the module docstring for one compressed row.

    Args:
        oracle: an HF reference engine on the learner's weights (a mixture of experts).
        samples: the row's samples (prompt and response ids), in batch order.
        compression: the row's KV compression.
        old_log_probs, response_mask: ``[B, T]`` the learner's dense recompute and the response mask.
        contaminated_frac: the row's ``sparse/contaminated_frac`` (the sampler's own routing).
        veto_threshold: the correction's veto threshold (None / 0: the reference's).
    """
    rows = [i for i, s in enumerate(samples) if s.response_ids]
    prompts = [samples[i].prompt_ids for i in rows]
    responses = [samples[i].response_ids for i in rows]
    dense = oracle.teacher_forced(prompts, responses, compression=CompressionConfig())
    own = oracle.teacher_forced(prompts, responses, compression=compression)
    rerouted = oracle.teacher_forced(prompts, responses, compression=compression,
                                     routing=[d.metadata["routing"] for d in dense])
    flips = [routing_flips(o.metadata["routing"], d.metadata["routing"]) for o, d in zip(own, dense)]
    pairs = sum(f.numel() for f in flips)
    fed = sum(f.shape[0] for f in flips)
    sampler = torch.zeros_like(old_log_probs)
    for i, r in zip(rows, rerouted):
        sampler[i, :len(r.sampler_logprobs)] = r.sampler_logprobs
    mask = response_mask.to(torch.bool)
    log_rho = sparsity_log_ratio(old_log_probs, sampler, mask)
    has = mask.any(dim=-1)
    n_seq = max(int(has.sum()), 1)
    contaminated = float((sequence_veto(log_rho, mask, CONTAMINATION_THRESHOLD) & has).sum()) / n_seq
    tail = rho_summary(log_rho, mask)
    return {
        MN.MOE_ROUTING_FLIP_FRAC: sum(int(f.sum()) for f in flips) / pairs if pairs else 0.0,
        MN.MOE_TOKEN_FLIP_FRAC: sum(int(f.any(dim=-1).sum()) for f in flips) / fed if fed else 0.0,
        MN.MOE_CONTAMINATED_FRAC_DENSE_ROUTING: contaminated,
        MN.MOE_ROUTING_CONTAMINATION: contaminated_frac - contaminated,
        MN.MOE_RHO_P1_DENSE_ROUTING: tail[MN.RHO_P1],
        MN.MOE_RHO_MIN_DENSE_ROUTING: tail[MN.RHO_MIN],
        MN.MOE_WOULD_VETO_FRAC_DENSE_ROUTING: float((would_veto(log_rho, mask, veto_threshold) & has).sum()) / n_seq,
        MN.MOE_REPLAY_MAX_ABS_DIFF: max((float((samples[i].sampler_logprobs - o.sampler_logprobs).abs().max())
                                        for i, o in zip(rows, own)), default=0.0),
    }


def replay_split(samples: Sequence["Sample"], learner_routes: Sequence[torch.Tensor], replayed_log_probs: torch.Tensor,
                 sampler_log_probs: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """The engine-vs-learner statistics of the module docstring for one row.

    Args:
        samples: the row's samples, each with the sampler's ``routed_experts``.
        learner_routes: per sample the learner's own experts of the same fed tokens (``Learner.routes``).
        replayed_log_probs, sampler_log_probs, response_mask: ``[B, T]`` the learner's recompute replaying the
            sampler's routes, the sampler's log-probs, the response mask.
    """
    every = [routing_flips(s.routed_experts.long(), mine.long()) for s, mine in zip(samples, learner_routes)]
    flips = [f[len(s.prompt_ids):] for s, f in zip(samples, every)]  # [R - 1, layers] per sample
    prompt = [f[:len(s.prompt_ids)] for s, f in zip(samples, every)]
    pairs = sum(f.numel() for f in flips)
    fed = sum(f.shape[0] for f in flips)
    mask = response_mask.to(torch.bool)
    log_rho = sparsity_log_ratio(replayed_log_probs, sampler_log_probs, mask)
    has = mask.any(dim=-1)
    n_seq = max(int(has.sum()), 1)
    tail = rho_summary(log_rho, mask)
    return {
        MN.MOE_LEARNER_FLIP_FRAC: sum(int(f.sum()) for f in flips) / pairs if pairs else 0.0,
        MN.MOE_LEARNER_TOKEN_FLIP_FRAC: sum(int(f.any(dim=-1).sum()) for f in flips) / fed if fed else 0.0,
        MN.MOE_LEARNER_PROMPT_FLIP_FRAC: sum(int(f.sum()) for f in prompt) / max(sum(f.numel() for f in prompt), 1),
        MN.MOE_CONTAMINATED_FRAC_REPLAY: float((sequence_veto(log_rho, mask, CONTAMINATION_THRESHOLD) & has).sum())
        / n_seq,
        MN.MOE_RHO_P1_REPLAY: tail[MN.RHO_P1],
        MN.MOE_RHO_MIN_REPLAY: tail[MN.RHO_MIN],
        MN.MOE_LOG_RHO_ABS_MAX_REPLAY: tail[MN.LOG_RHO_ABS_MAX],
    }
