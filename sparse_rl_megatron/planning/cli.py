"""``sparse-rl plan``: per-GPU memory of a learner layout and the rollout KV budget, before renting GPUs.

    sparse-rl plan --model qwen2.5-7b --tp 4 --dp 2 --response-len 4096 --compression rkv --budget 512 --buffer 128

The model is a bundled name (``sparse_rl_megatron/models/configs``) or an HF checkpoint directory (only its
config.json is read). Nothing heavy is imported until the arguments are parsed, so ``--help`` is instant.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="bundled model name (e.g. qwen2.5-7b, qwen3-8b) or HF checkpoint dir")
    g = p.add_argument_group("layout")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the learner (default 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1; or give --gpus)")
    g.add_argument("--gpus", type=int, default=None, help="total GPUs; sets DP = GPUs / (TP x PP)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size of a mixture of experts (default 1)")
    g.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp, as the learner)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; TP stays in a node (default 8)")
    g.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    g = p.add_argument_group("batch")
    g.add_argument("--prompts", type=int, default=32, help="prompts per step (default 32)")
    g.add_argument("--samples", type=int, default=8, help="responses per prompt (default 8)")
    g.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    g.add_argument("--response-len", type=int, default=4096, help="response tokens (default 4096)")
    g.add_argument("--max-tokens-per-device", type=int, default=16384, help="micro-batch token budget (default 16384)")
    g.add_argument("--logprob-chunk", type=int, default=512, help="LM-head chunk in tokens, 0 = unchunked (default 512)")
    g = p.add_argument_group("learner")
    g.add_argument("--params-dtype", default="bfloat16", help="bfloat16 (default) or float32")
    g.add_argument("--kernels", default="fused", help="fused (Transformer Engine; default) or local (megatron-core, CPU)")
    g.add_argument("--recompute", default="none", help="activation recompute: none (default) or full")
    g.add_argument("--no-distributed-optimizer", action="store_true", help="keep Adam state unsharded")
    g.add_argument("--kl-reference", action="store_true", help="a frozen KL reference policy is also held")
    g = p.add_argument_group("rollout")
    g.add_argument("--compression", default="none", help="KV compressor next to dense: rkv, snapkv, ... (default none)")
    g.add_argument("--budget", type=int, default=512, help="B: KV tokens kept per layer and head (default 512)")
    g.add_argument("--buffer", type=int, default=128, help="W: tokens decoded between compressions (default 128)")
    g.add_argument("--window", type=int, default=8, help="alpha: observation window (default 8)")
    g.add_argument("--mean-budget", type=int, default=None,
                   help="adaptive budget: its mean B, one more column; --budget is then the worst case, B_max")
    g.add_argument("--rollout-tp", type=int, default=None, help="rollout engine TP size (default: the learner's TP)")
    g.add_argument("--kv-dtype", default="bfloat16", help="KV cache dtype (default bfloat16)")
    g.add_argument("--mem-fraction", type=float, default=0.85, help="GPU share of the engine (default 0.85)")
    g.add_argument("--kv-pool", type=float, default=None, help="KV pool per GPU in GiB (default: derived)")
    g.add_argument("--max-running-requests", type=int, default=None,
                   help="request rows of an SGLang engine; the sparse_kv plugin's memory grows with them "
                        "(default: SGLang's, at most 4096)")


def _inputs(args: argparse.Namespace):
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.models.arch import arch_from_hf_config
    from sparse_rl_megatron.models.catalog import hf_config
    from sparse_rl_megatron.planning.inputs import BatchShape, Layout, LearnerSetting, RolloutSetting

    if args.recompute not in ("none", "full"):
        raise ValueError(f"--recompute must be none or full, got {args.recompute!r}")
    arch = arch_from_hf_config(hf_config(args.model))
    dp = args.dp
    if args.gpus is not None:
        if args.gpus < 1 or args.gpus % (args.tp * args.pp):
            raise ValueError(f"--gpus {args.gpus} is not a multiple of --tp x --pp = {args.tp * args.pp}")
        dp = args.gpus // (args.tp * args.pp)
    layout = Layout(args.tp, args.pp, dp, args.gpus_per_node, args.gpu_memory, ep=args.ep, etp=args.etp)
    batch = BatchShape(args.prompts, args.samples, args.prompt_len, args.response_len)
    learner = LearnerSetting(params_dtype=args.params_dtype, distributed_optimizer=not args.no_distributed_optimizer,
                             recompute=args.recompute == "full", kernels=args.kernels,
                             max_tokens_per_device=args.max_tokens_per_device, logprob_chunk_tokens=args.logprob_chunk,
                             reference_model=args.kl_reference)
    rollout = RolloutSetting(tp=args.rollout_tp or args.tp, kv_dtype=args.kv_dtype, mem_fraction=args.mem_fraction,
                             kv_pool_gib=args.kv_pool, max_running_requests=args.max_running_requests)
    try:
        compression = CompressionConfig(method=args.compression, budget=args.budget, buffer=args.buffer,
                                        window=args.window)
    except ValueError as err:  # name the option rather than the config field
        raise ValueError(str(err).replace("CompressionConfig.method", "--compression")
                         .replace("CompressionConfig.", "--")) from None
    if args.mean_budget is not None:
        if compression.is_dense:
            raise ValueError("--mean-budget needs --compression (an adaptive budget of a compressor)")
        if not compression.window < args.mean_budget <= compression.budget:
            raise ValueError(f"--mean-budget must be in (--window, --budget] = ({compression.window}, "
                             f"{compression.budget}] (--budget is the adaptive budget's B_max); got {args.mean_budget}")
    return arch, layout, batch, learner, rollout, compression


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.planning.plan import build_plan
    from sparse_rl_megatron.planning.report import render

    try:
        arch, layout, batch, learner, rollout, compression = _inputs(args)
        plan = build_plan(args.model, arch, layout, batch, learner, rollout, compression, args.mean_budget)
    except (ValueError, FileNotFoundError) as err:
        print(f"sparse-rl plan: error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(render(plan))
    return 0 if plan.fits and plan.rollout_fits else 1
