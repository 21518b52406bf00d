"""Math rewards: final-answer extraction, math-verify equivalence in a process pool with a time limit.

Nothing here imports torch, so verifier workers start quickly.
"""
from sparse_rl_megatron.rewards.extract import ANSWER_STYLES, extract_answer, gsm8k_gold, last_boxed, trailing_number
from sparse_rl_megatron.rewards.pool import VerifierPool, VerifierPoolConfig
from sparse_rl_megatron.rewards.reward import MathReward, reason_counts
from sparse_rl_megatron.rewards.verify import REASONS, Verdict, check_answer, normalize_gold

__all__ = [
    "ANSWER_STYLES", "MathReward", "REASONS", "Verdict", "VerifierPool", "VerifierPoolConfig", "check_answer",
    "extract_answer", "gsm8k_gold", "last_boxed", "normalize_gold", "reason_counts", "trailing_number",
]
