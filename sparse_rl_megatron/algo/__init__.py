"""Sparse-RL math, framework-free (imports torch, the stdlib and ``utils.registry`` only).

Sparse-RL (Luo et al., ACL 2026, arXiv 2601.10079): GRPO whose rollouts come from a sampler ``pi_sparse``
running on a compressed KV cache, corrected with the ratio ``rho = pi_old / pi_sparse`` by rejection
sampling and importance reweighting. See ``docs/algorithm.md`` for the math, defaults and denominators.

Tensors are padded and response-aligned: ``[B, T]`` per token (B samples, T response tokens) with a
``mask [B, T]`` (bool or 0/1) marking real response tokens; ``rewards [B]``, ``group_ids [B]`` per sample.

Data flow::

    # once per rollout, on the GLOBAL batch (all samples of the rollout step, before any update):
    #   old_log_probs     = learner's dense recompute with the pre-update weights   (pi_old)
    #   sampler_log_probs = rollout engine's log-probs of the sampled tokens        (pi_sparse)
    prepared = prepare_correction(old_log_probs, sampler_log_probs, mask, rewards, group_ids,
                                  CorrectionConfig())          # reference defaults
    log(prepared.metrics)                                       # sparse/* on the unmodified masks

    # per optimizer step, per micro-batch (rows of the global batch):
    for mb in prepared.micro_batches(n):                       # or prepared.select(row_indices)
        log_probs = model(...)                                  # pi_theta, [b, T], with grad
        loss, metrics = micro_batch_loss(log_probs, mb, LossConfig(), ref_log_probs=..., entropy=...)
        loss.backward()                                         # shares add up to the global loss
    # SUM metrics over micro-batches and data-parallel ranks

Every micro-batch uses the GLOBAL normalisers carried by ``prepared.normalisers`` (weight sum, kept tokens,
kept sequences), so 1, 2 or 4 micro-batches (or DP ranks) give the same total gradient. A learner holding
only a shard can rebuild them: ``local_normalisers(...)`` per shard, summed / all-reduced
(``GlobalNormalisers.as_tensor`` / ``from_tensor``), and ``weight_stats`` + ``normalise_weights``.

Which log-probs go where: rho = pi_old / pi_sparse (dense old over sampler); PPO ratio = pi_theta / pi_old
(current over dense old). The sampler's log-probs never meet the current policy's.

slime users: ``--custom-tis-function-path sparse_rl_megatron.algo.slime_hook.sparse_rl_correction``.
"""
from sparse_rl_megatron.algo.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from sparse_rl_megatron.algo.config import CorrectionConfig
from sparse_rl_megatron.algo.correction import PreparedBatch, prepare_correction
from sparse_rl_megatron.algo.entropy import entropy_from_logits
from sparse_rl_megatron.algo.hooks import check_hook_signature, load_hook
from sparse_rl_megatron.algo.kl import KL_ESTIMATORS, kl_penalty
from sparse_rl_megatron.algo.loss import LossConfig, micro_batch_loss
from sparse_rl_megatron.algo.metrics import mismatch_metrics
from sparse_rl_megatron.algo.modes import CORRECTION_MODES, Correction, CorrectionInputs, CorrectionMode, register_correction_mode
from sparse_rl_megatron.algo.normalisers import GlobalNormalisers, local_normalisers
from sparse_rl_megatron.algo.policy_loss import ppo_clip_loss
from sparse_rl_megatron.algo.ratio import LOG_RATIO_CLAMP, sparsity_log_ratio
from sparse_rl_megatron.algo.reductions import REDUCTIONS, local_denominator, reduce_loss
from sparse_rl_megatron.algo.rejection import REJECTION_KEYS, REJECTION_LEVELS, RejectionResult, reject, sequence_veto
from sparse_rl_megatron.algo.reweighting import (
    WEIGHT_MODES,
    importance_weights,
    normalisation_factor,
    normalise_weights,
    weight_stats,
)
from sparse_rl_megatron.algo.slime_hook import sparse_rl_correction

__all__ = [
    "ADVANTAGE_ESTIMATORS", "CORRECTION_MODES", "KL_ESTIMATORS", "REDUCTIONS", "REJECTION_KEYS", "REJECTION_LEVELS",
    "WEIGHT_MODES", "LOG_RATIO_CLAMP",
    "CorrectionConfig", "CorrectionMode", "CorrectionInputs", "Correction", "register_correction_mode", "LossConfig", "PreparedBatch", "GlobalNormalisers", "RejectionResult",
    "prepare_correction", "micro_batch_loss",
    "sparsity_log_ratio", "reject", "sequence_veto", "importance_weights", "weight_stats", "normalisation_factor",
    "normalise_weights", "compute_advantages", "ppo_clip_loss", "kl_penalty", "entropy_from_logits",
    "reduce_loss", "local_denominator", "local_normalisers", "mismatch_metrics",
    "load_hook", "check_hook_signature", "sparse_rl_correction",
]
