"""Benchmark evaluation: model x benchmarks x inference mode (dense or compressed KV) x sampling."""
from sparse_rl_megatron.eval.config import PAPER_PRESET, BenchmarkSettings, EvalConfig
from sparse_rl_megatron.eval.metrics import avg_at_k, mean_pass_at_k, pass_at_k

__all__ = ["BenchmarkSettings", "EvalConfig", "PAPER_PRESET", "avg_at_k", "mean_pass_at_k", "pass_at_k"]
