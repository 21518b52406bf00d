"""``sparse-rl plan``: per-GPU memory of a learner layout and the rollout KV budget, before renting GPUs.

    sparse-rl plan --model qwen2.5-7b --tp 4 --dp 2 --response-len 4096 --compression rkv --budget 512 --buffer 128
    sparse-rl plan --config configs/recipes/qwen2.5-7b/rkv.yaml [key=value ...]

The model is a bundled name (``sparse_rl_megatron/models/configs``) or an HF checkpoint directory (only its
config.json is read). Nothing heavy is imported until the arguments are parsed, so ``--help`` is instant.
"""
from __future__ import annotations

import argparse
import sys


RECIPE_OPTIONS = ("tp", "pp", "dp", "gpus", "ep", "etp", "prompts", "samples", "response_len", "max_tokens_per_device",
                  "logprob_chunk", "params_dtype", "kernels", "recompute", "no_distributed_optimizer", "kl_reference",
                  "offload", "compression", "budget", "buffer", "window", "mean_budget", "rollout_tp", "kv_dtype",
                  "kv_pool", "max_running_requests", "no_memory_saver", "bucket_mb")
"""Options a recipe gives with ``--config`` (its own values are changed with ``key=value`` overrides instead)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="bundled model name (e.g. qwen2.5-7b, qwen3-8b) or HF checkpoint dir (with --config: instead "
                        "of the recipe's model_path)")
    p.add_argument("--config", default=None,
                   help="plan a training recipe (YAML, as sparse-rl train reads it): its layout, batch, learner and "
                        "engine settings; the layout/batch/learner/rollout options are then the recipe's")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the --config recipe")
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
    g.add_argument("--offload", default="none",
                   help="what of the learner sleeps while the engines decode: a learner.offload mode "
                        "(learner/offload.py; default none: nothing)")
    g = p.add_argument_group("rollout")
    from sparse_rl_megatron.compression.scorers import methods_help

    g.add_argument("--compression", default="none", help=f"KV compressor next to dense: {methods_help(dense=False)} "
                                                         "(default none)")
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
    g.add_argument("--no-memory-saver", action="store_true",
                   help="SGLang without its memory saver: the released engine keeps its weights and KV pool while "
                        "the learner trains (rollout.sglang.memory_saver false)")
    g.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket in MiB (sync.bucket_mb; default 512)")


def _recipe_inputs(args: argparse.Namespace):
    from sparse_rl_megatron.models.arch import arch_from_hf_config
    from sparse_rl_megatron.models.catalog import hf_config
    from sparse_rl_megatron.planning.recipe import read_recipe

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    given = [o for o in RECIPE_OPTIONS if getattr(args, o) != getattr(defaults, o)]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} is the recipe's with --config; change the recipe's value "
                         "with a key=value override (e.g. learner.offload=all)")
    recipe = read_recipe(args.config, args.overrides, model=args.model, gpus_per_node=args.gpus_per_node,
                         gpu_memory_gib=args.gpu_memory, prompt_len=args.prompt_len,
                         mem_fraction=None if args.mem_fraction == defaults.mem_fraction else args.mem_fraction)
    arch = arch_from_hf_config(hf_config(recipe.model))
    return recipe.model, arch, recipe.layout, recipe.batch, recipe.learner, recipe.rollout, recipe.compression


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
                             reference_model=args.kl_reference, offload=args.offload)
    rollout = RolloutSetting(tp=args.rollout_tp or args.tp, kv_dtype=args.kv_dtype, mem_fraction=args.mem_fraction,
                             kv_pool_gib=args.kv_pool, max_running_requests=args.max_running_requests,
                             memory_saver=not args.no_memory_saver, bucket_mb=args.bucket_mb)
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
    return args.model, arch, layout, batch, learner, rollout, compression


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.planning.plan import build_plan
    from sparse_rl_megatron.planning.report import render

    try:
        if args.config is None:
            if args.model is None or args.overrides:
                raise ValueError("give --model NAME (or --config RECIPE" + (", whose values key=value overrides change"
                                                                            if args.overrides else "") + ")")
            model, arch, layout, batch, learner, rollout, compression = _inputs(args)
        else:
            model, arch, layout, batch, learner, rollout, compression = _recipe_inputs(args)
        plan = build_plan(model, arch, layout, batch, learner, rollout, compression, args.mean_budget)
    except (ValueError, FileNotFoundError) as err:
        print(f"sparse-rl plan: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    sys.stdout.write(render(plan))
    return 0 if plan.all_fit else 1
