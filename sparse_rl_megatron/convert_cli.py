"""``sparse-rl convert``: HF <-> Megatron (torch_dist) checkpoints.

    sparse-rl convert hf-to-megatron --input Qwen2.5-3B/ --output ckpt/qwen2.5-3b-mcore
    sparse-rl convert megatron-to-hf --input ckpt/step_100 --output hf/step_100 [--dtype bfloat16]

hf-to-megatron builds the model at TP x PP (a single process: 1 x 1; under torchrun: any layout that divides
the world size) and saves a checkpoint that any other layout can load. megatron-to-hf needs no model and
one process: it reads the global tensors and writes safetensors, config.json and the tokenizer files.
"""
from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger(__name__)

DIRECTIONS = ("hf-to-megatron", "megatron-to-hf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("direction", choices=DIRECTIONS, help="conversion direction")
    parser.add_argument("--input", required=True, help="source checkpoint directory")
    parser.add_argument("--output", required=True, help="destination directory (created)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="hf-to-megatron: TP layout to build")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, help="hf-to-megatron: PP layout to build")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="parameter dtype (hf-to-megatron) or output dtype (megatron-to-hf); "
                             "default: the HF checkpoint's dtype")


def run(args: argparse.Namespace) -> int:
    log.info("loading torch%s", " and megatron-core" if args.direction == "hf-to-megatron" else "")
    from sparse_rl_megatron.learner.convert import export_to_hf, import_from_hf

    try:
        if args.direction == "hf-to-megatron":
            out = import_from_hf(
                args.input, args.output, tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size, params_dtype=args.dtype,
            )
        else:
            out = export_to_hf(args.input, args.output, dtype=args.dtype)
    except (FileNotFoundError, FileExistsError, ValueError, KeyError) as err:
        print(f"sparse-rl convert: error: {err}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"wrote {out}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
