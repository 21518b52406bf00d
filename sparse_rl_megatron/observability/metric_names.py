"""Every metric key of a run's ``metrics.jsonl`` (and TensorBoard), in one home: the writers and the readers
(the plots, the experiment's results, analysis and figures, ``sparse-rl mismatch``, the progress line, the adaptive
budget) import these names instead of spelling the keys, so a key is renamed in one place. The keys are namespaced
strings, byte for byte those of saved runs: a metrics file of an older run reads the same.

Families with a variable part are built by a function (``eval_key``); ``tests/unit/test_metric_names.py`` checks that
no module of the package spells a key outside this one.
"""
from __future__ import annotations

import re

DENSE = "dense"
SPARSE = "sparse"
ADAPTIVE = "adaptive"
"""Evaluation modes: dense inference, sparse (the run's compression), the adaptive budget's."""
ACCURACY = "accuracy"
SHORTCUT_FREE_ACCURACY = "shortcut_free_accuracy"
FULL_CHAIN_FRAC = "full_chain_frac"
NO_ANSWER_FRAC = "no_answer_frac"
TRUNCATED_FRAC = "truncated_frac"
BUDGET = "budget"
RESPONSE_LEN = "response_len"
PROBLEMS = "problems"
SHORTCUT_FREE_PROBLEMS = "shortcut_free_problems"
"""The last part of an ``eval/...`` key."""
SUBSET_PREFIX = "subset_"
"""Before a class's name in its keys: ``eval/<mode>/<data set>/subset_<class>/<metric>``."""
SUBSET_ACCURACY_KEY = re.compile(r"^eval/(dense|sparse)/[^/]+/subset_([^/]+)/accuracy$")
"""A class's dense or sparse accuracy key; groups: the mode, the class."""


def eval_key(mode: str, *parts: str) -> str:
    """``eval/<mode>/<parts...>``: ``eval_key(DENSE, ACCURACY)`` is ``eval/dense/accuracy``; a data set's and a class's
    keys put their names between (``eval_key(DENSE, "gsm8k", ACCURACY)``)."""
    return "/".join(("eval", mode, *parts))


def control_key(sft_key: str) -> str:
    """The supervised control arm's record of a warm-start metric: ``sft/steps`` -> ``control/steps``."""
    return "control/" + sft_key.split("/", 1)[1]


# ---------------------------------------------------------------- rollout/
# A step's rollouts (``trainer/engine_pool/pool.py``, the adaptive budget ``compression/budget_controller.py``, the
# loop).
PARTIAL_SEGMENTS = "rollout/partial/segments"
PARTIAL_NEW_GROUPS = "rollout/partial/new_groups"
PARTIAL_DROPPED_GROUPS = "rollout/partial/dropped_groups"
PARTIAL_DROPPED_SAMPLES = "rollout/partial/dropped_samples"
PARTIAL_CARRIED_REQUESTS = "rollout/partial/carried_requests"
PARTIAL_WAITING_GROUPS = "rollout/partial/waiting_groups"
PARTIAL_CONTINUED_FRAC = "rollout/partial/continued_frac"
PARTIAL_STALENESS_MEAN = "rollout/partial/staleness_mean"
PARTIAL_STALENESS_MAX = "rollout/partial/staleness_max"
"""Partial rollouts (``trainer/partial_rollouts.py``): segments this step (one engine call per engine each), groups
started, groups (and their samples) dropped for staleness, requests still running at the step's end, finished groups
waiting for a later step, the batch's samples continued across calls, and the batch tokens' lag in weight versions."""


def partial_lag_share(lag: int, or_more: bool = False) -> str:
    """The share of the batch's response tokens sampled ``lag`` versions before the learner's (``or_more``: at least)."""
    return f"rollout/partial/lag_{lag}{'plus' if or_more else ''}_frac"


def partial_abs_log_rho(tokens: str, stat: str) -> str:
    """``stat`` (mean, p99) of |log rho| over the tokens of one lag class (``lag0``: the learner's version; ``lagged``)."""
    return f"sparse/partial/abs_log_rho_{tokens}_{stat}"


ROLLOUT_BUDGET = "rollout/budget"
ROLLOUT_BUDGET_SAMPLED_MEAN = "rollout/budget_sampled_mean"
ROLLOUT_BUDGET_SIGNAL = "rollout/budget_signal"
ROLLOUT_BUDGET_TARGET = "rollout/budget_target"
ROLLOUT_COMPRESSION_EVENTS_MEAN = "rollout/compression_events_mean"
ROLLOUT_GROUPS_WITH_SIGNAL_FRAC = "rollout/groups_with_signal_frac"
ROLLOUT_KV_RETAINED_FRAC = "rollout/kv_retained_frac"
ROLLOUT_KV_TOKENS_DENSE_MEAN = "rollout/kv_tokens_dense_mean"
ROLLOUT_KV_TOKENS_PEAK_MAX = "rollout/kv_tokens_peak_max"
ROLLOUT_KV_TOKENS_PEAK_MEAN = "rollout/kv_tokens_peak_mean"
ROLLOUT_REDRAWN_FRAC = "rollout/redrawn_frac"
ROLLOUT_REDRAWS = "rollout/redraws"
ROLLOUT_REPETITION_RATE = "rollout/repetition_rate"
ROLLOUT_RESPONSE_LEN_MAX = "rollout/response_len_max"
ROLLOUT_RESPONSE_LEN_MEAN = "rollout/response_len_mean"
ROLLOUT_RETRACTED_FRAC = "rollout/retracted_frac"
ROLLOUT_RETRACTIONS = "rollout/retractions"
ROLLOUT_REWARD_MEAN = "rollout/reward_mean"
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
ROLLOUT_WEIGHT_VERSION = "rollout/weight_version"

# ---------------------------------------------------------------- sparse/
# The Sparse-RL correction on the step's batch (``algo/metrics.py``, ``algo/diagnostics.py``, ``algo/correction.py``,
# the slime hook ``algo/slime_hook.py``).
SPARSE_CONTAMINATED_FRAC = "sparse/contaminated_frac"
SPARSE_ENTROPY_DENSE = "sparse/entropy_dense"
SPARSE_ENTROPY_SAMPLER = "sparse/entropy_sampler"
SPARSE_ESS = "sparse/ess"
SPARSE_KEPT_SEQS = "sparse/kept_seqs"
SPARSE_KEPT_TOKENS = "sparse/kept_tokens"
SPARSE_KL_K1 = "sparse/kl_k1"
SPARSE_KL_K3 = "sparse/kl_k3"
SPARSE_KL_OLD_SPARSE_K1 = "sparse/kl_old_sparse_k1"
SPARSE_KL_OLD_SPARSE_K3 = "sparse/kl_old_sparse_k3"
SPARSE_LOG_PPL_DIFF = "sparse/log_ppl_diff"
SPARSE_LOG_PPL_OLD = "sparse/log_ppl_old"
SPARSE_LOG_PPL_SPARSE = "sparse/log_ppl_sparse"
SPARSE_NUM_SEQS = "sparse/num_seqs"
SPARSE_REJECTED_SEQ = "sparse/rejected_seq"
SPARSE_REJECTED_SEQ_FRAC = "sparse/rejected_seq_frac"
SPARSE_REJECTED_TOKEN = "sparse/rejected_token"
SPARSE_REJECTED_TOKEN_FRAC = "sparse/rejected_token_frac"
SPARSE_REWARD_MEAN_KEPT = "sparse/reward_mean_kept"
SPARSE_REWARD_MEAN_REJECTED = "sparse/reward_mean_rejected"
SPARSE_REWARD_MEAN_WOULD_KEEP = "sparse/reward_mean_would_keep"
SPARSE_REWARD_MEAN_WOULD_VETO = "sparse/reward_mean_would_veto"
SPARSE_RHO = "sparse/rho"
SPARSE_RHO_MAX = "sparse/rho_max"
SPARSE_RHO_MEAN = "sparse/rho_mean"
SPARSE_RHO_MIN = "sparse/rho_min"
SPARSE_RHO_P1 = "sparse/rho_p1"
SPARSE_RHO_P5 = "sparse/rho_p5"
SPARSE_RHO_P50 = "sparse/rho_p50"
SPARSE_TOKEN_ABOVE = "sparse/token_above"
SPARSE_TOKEN_ABOVE_FRAC = "sparse/token_above_frac"
SPARSE_TOKEN_BELOW = "sparse/token_below"
SPARSE_TOKEN_BELOW_FRAC = "sparse/token_below_frac"
SPARSE_TRUNCATED = "sparse/truncated"
SPARSE_TRUNCATED_FRAC = "sparse/truncated_frac"
SPARSE_VETOED_SEQ = "sparse/vetoed_seq"
SPARSE_VETOED_SEQ_FRAC = "sparse/vetoed_seq_frac"
SPARSE_WEIGHT = "sparse/weight"
SPARSE_WEIGHT_MEAN = "sparse/weight_mean"
SPARSE_WEIGHT_NORM_FACTOR = "sparse/weight_norm_factor"
SPARSE_WOULD_VETO_FRAC = "sparse/would_veto_frac"

# ---------------------------------------------------------------- rho/
# Quantiles of the ratio rho = pi_old / pi_sparse over a batch's response tokens (``algo/rho_stats.py``; ``sparse-rl
# mismatch``).
RHO_MAX = "rho/max"
RHO_MEAN = "rho/mean"
RHO_MIN = "rho/min"
RHO_P0_1 = "rho/p0.1"
RHO_P1 = "rho/p1"
RHO_P5 = "rho/p5"
RHO_P50 = "rho/p50"
RHO_P99 = "rho/p99"

# ---------------------------------------------------------------- log_rho/
# The log of rho, per token and summed per sequence (``algo/rho_stats.py``).
LOG_RHO_ABS_MAX = "log_rho/abs_max"
LOG_RHO_ABS_MEAN = "log_rho/abs_mean"
LOG_RHO_SEQ_SUM_MEAN = "log_rho/seq_sum_mean"
LOG_RHO_SEQ_SUM_MIN = "log_rho/seq_sum_min"

# ---------------------------------------------------------------- loss/
# The policy loss of the optimizer steps (``algo/loss.py``).
LOSS_CLIP_FRAC = "loss/clip_frac"
LOSS_CLIP_FRAC_ALL_TOKENS = "loss/clip_frac_all_tokens"
LOSS_ENTROPY = "loss/entropy"
LOSS_KL = "loss/kl"
LOSS_PG = "loss/pg"
LOSS_PPO_KL = "loss/ppo_kl"
LOSS_TOTAL = "loss/total"

# ---------------------------------------------------------------- train/
# The learner's optimizer steps (``learner/train_step.py``, ``trainer/optimize.py``).
TRAIN_ALL_REJECTED = "train/all_rejected"
TRAIN_EMPTY_SLICES = "train/empty_slices"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_GRAD_NORM_MAX = "train/grad_norm_max"
TRAIN_KEPT_SEQS = "train/kept_seqs"
TRAIN_KEPT_TOKENS = "train/kept_tokens"
TRAIN_LR = "train/lr"
TRAIN_MICRO_BATCHES = "train/micro_batches"
TRAIN_MOE_LOAD_BALANCING_LOSS = "train/moe_load_balancing_loss"
TRAIN_OPTIMIZER_STEPS = "train/optimizer_steps"
TRAIN_SKIPPED = "train/skipped"
TRAIN_SKIPPED_TOTAL = "train/skipped_total"
TRAIN_STEP = "train/step"
TRAIN_STEP_TIME_S = "train/step_time_s"
TRAIN_TOKENS = "train/tokens"
TRAIN_TOKENS_PER_S = "train/tokens_per_s"

# ---------------------------------------------------------------- sync/
# The weight push to the engines and its probe (``trainer/engine_pool/pool.py``).
SYNC_BUCKETS = "sync/buckets"
SYNC_MIB = "sync/mib"
SYNC_PROBE_MAX_ABS_DIFF = "sync/probe_max_abs_diff"
SYNC_PROBE_MEAN_ABS_DIFF = "sync/probe_mean_abs_diff"
SYNC_SECONDS = "sync/seconds"

# ---------------------------------------------------------------- time/
# Seconds per phase of a step (the loop, ``trainer/step.py``, the pool, the evaluation).
TIME_EVAL_S = "time/eval_s"
TIME_RECOMPUTE_S = "time/recompute_s"
TIME_REF_S = "time/ref_s"
TIME_REWARD_S = "time/reward_s"
TIME_ROLLOUT_ENGINE_MIN_S = "time/rollout_engine_min_s"
TIME_ROLLOUT_PHASE_S = "time/rollout_phase_s"
TIME_ROLLOUT_S = "time/rollout_s"
TIME_SYNC_S = "time/sync_s"
TIME_TRAIN_S = "time/train_s"

# ---------------------------------------------------------------- throughput/
# Rates of a step (``trainer/engine_pool/pool.py``).
THROUGHPUT_ROLLOUT_TOKENS_PER_S = "throughput/rollout_tokens_per_s"

# ---------------------------------------------------------------- moe/
# The routing of mixtures of experts, measured by ``sparse-rl mismatch`` (``mismatch/routing.py``).
MOE_CONTAMINATED_FRAC_DENSE_ROUTING = "moe/contaminated_frac_dense_routing"
MOE_CONTAMINATED_FRAC_REPLAY = "moe/contaminated_frac_replay"
MOE_LEARNER_FLIP_FRAC = "moe/learner_flip_frac"
MOE_LEARNER_PROMPT_FLIP_FRAC = "moe/learner_prompt_flip_frac"
MOE_LEARNER_TOKEN_FLIP_FRAC = "moe/learner_token_flip_frac"
MOE_LOG_RHO_ABS_MAX_REPLAY = "moe/log_rho_abs_max_replay"
MOE_REPLAY_MAX_ABS_DIFF = "moe/replay_max_abs_diff"
MOE_RHO_MIN_DENSE_ROUTING = "moe/rho_min_dense_routing"
MOE_RHO_MIN_REPLAY = "moe/rho_min_replay"
MOE_RHO_P1_DENSE_ROUTING = "moe/rho_p1_dense_routing"
MOE_RHO_P1_REPLAY = "moe/rho_p1_replay"
MOE_ROUTING_CONTAMINATION = "moe/routing_contamination"
MOE_ROUTING_FLIP_FRAC = "moe/routing_flip_frac"
MOE_TOKEN_FLIP_FRAC = "moe/token_flip_frac"
MOE_WOULD_VETO_FRAC_DENSE_ROUTING = "moe/would_veto_frac_dense_routing"

# ---------------------------------------------------------------- sft/
# A task's supervised warm start (``tasks/sft.py``, ``tasks/modchain.py``).
SFT_CPU_SECONDS = "sft/cpu_seconds"
SFT_HELDOUT_ACC = "sft/heldout_acc"
SFT_LOSS_FIRST = "sft/loss_first"
SFT_LOSS_LAST = "sft/loss_last"
SFT_SECONDS = "sft/seconds"
SFT_SECONDS_PER_STEP = "sft/seconds_per_step"
SFT_SEED = "sft/seed"
SFT_STEPS = "sft/steps"

# ---------------------------------------------------------------- check/
# The warm start's check (``trainer/runtime/model_dirs.py``; the measured values are ``check/<name>``).
CHECK_PASSED = "check/passed"

# ---------------------------------------------------------------- eval/
# Held-out evaluation (``trainer/evaluation.py``): ``eval/<mode>/<metric>`` and, per data set and class of problems,
# ``eval/<mode>/<data set>[/subset_<class>]/<metric>`` (``eval_key``).
EVAL_ADAPTIVE_ACCURACY = eval_key(ADAPTIVE, ACCURACY)
EVAL_ADAPTIVE_SHORTCUT_FREE_ACCURACY = eval_key(ADAPTIVE, SHORTCUT_FREE_ACCURACY)
EVAL_DENSE_ACCURACY = eval_key(DENSE, ACCURACY)
EVAL_DENSE_FULL_CHAIN_FRAC = eval_key(DENSE, FULL_CHAIN_FRAC)
EVAL_DENSE_MODCHAIN_WEAK_ODD_X_STOP_ACCURACY = eval_key(DENSE, "modchain_weak", "subset_odd_x_stop", ACCURACY)
EVAL_DENSE_MODCHAIN_WEAK_REST_ACCURACY = eval_key(DENSE, "modchain_weak", "subset_rest", ACCURACY)
EVAL_DENSE_NO_ANSWER_FRAC = eval_key(DENSE, NO_ANSWER_FRAC)
EVAL_DENSE_SHORTCUT_FREE_ACCURACY = eval_key(DENSE, SHORTCUT_FREE_ACCURACY)
EVAL_DENSE_TRUNCATED_FRAC = eval_key(DENSE, TRUNCATED_FRAC)
EVAL_SPARSE_ACCURACY = eval_key(SPARSE, ACCURACY)
EVAL_SPARSE_FULL_CHAIN_FRAC = eval_key(SPARSE, FULL_CHAIN_FRAC)
EVAL_SPARSE_SHORTCUT_FREE_ACCURACY = eval_key(SPARSE, SHORTCUT_FREE_ACCURACY)
