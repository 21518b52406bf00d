"""``sparse-rl eval``: a model on math benchmarks, dense or compressed-KV, through a rollout engine.

    sparse-rl eval --model MODEL_DIR [--benchmarks gsm8k,math500] [--compression rkv --budget 512]
                   [--n 4 --temperature 0.8 --top-p 0.95 --max-new-tokens 4096] [--output results.json]
    sparse-rl eval --compare dense.json sparse.json

Sampling defaults follow ``--preset paper`` (T = 0.8, top-p 0.95, 8192 tokens; AIME24 / AMC23 n = 32 at
16384 tokens); any flag given explicitly wins over the preset, for every benchmark.
"""
from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from sparse_rl_megatron.data.sets import BENCHMARKS, check_dataset
from sparse_rl_megatron.utils.dtypes import DTYPE_NAMES
from sparse_rl_megatron.utils.errors import UsageError, UserError, positive_int
from sparse_rl_megatron.utils.file_checks import check_model_dir, check_new_output, first_free_path

log = logging.getLogger(__name__)

PRESETS = ("paper", "none")
_BUILTIN = {"temperature": 0.8, "top_p": 0.95, "n": 1, "max_new_tokens": 8192}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", help="HF model directory or Megatron checkpoint (exported to HF first)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--benchmarks", default="all",
                   help=f"comma-separated named sets, JSONL/Parquet files or task:<name> (a built-in task's "
                        f"held-out split); 'all' = {','.join(BENCHMARKS)}")
    g.add_argument("--data-root", default=None, help="shared data folder (default ../shared/data or $SPARSE_RL_DATA)")
    g.add_argument("--limit", type=positive_int, default=None, help="first N problems of each benchmark")
    g.add_argument("--input-key", default="prompt", help="prompt field of a benchmark given as a file")
    g.add_argument("--label-key", default="answer", help="gold-answer field of a benchmark given as a file")
    g.add_argument("--template", default="qwen25_chat", help="prompt template name")
    g.add_argument("--export-dir", default=None, help="where a Megatron checkpoint is exported to HF (default: temp)")

    g = parser.add_argument_group("engine and inference mode")
    g.add_argument("--engine", default="hf", help="rollout engine name: hf (reference) or sglang (SGLang + sparse_kv plugin)")
    from sparse_rl_megatron.compression.scorers import methods_help

    g.add_argument("--compression", default="none", help=f"KV compressor: {methods_help()}")
    g.add_argument("--budget", type=positive_int, default=None, help="KV budget B (default 512; needs --compression)")
    g.add_argument("--window", type=positive_int, default=None, help="observation window alpha (default 8)")
    g.add_argument("--buffer", type=positive_int, default=None, help="buffer W: compress at B + W (default 128)")
    g.add_argument("--scope", default=None, help="budget scope: all (default) | response")
    g.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="compute dtype of the engine")
    g.add_argument("--max-batch-size", type=positive_int, default=64)

    g = parser.add_argument_group("sampling")
    g.add_argument("--preset", default="paper", choices=PRESETS, help="sampling defaults (explicit flags win)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--max-new-tokens", type=positive_int, default=None)
    g.add_argument("--n", type=positive_int, default=None, help="samples per problem")
    g.add_argument("--bench", action="append", default=[], metavar="NAME:n=K,max_new_tokens=M",
                   help="per-benchmark n / max_new_tokens (repeatable)")
    g.add_argument("--pass-k", default=None, help="comma-separated k of pass@k (default 1, powers of 2, n)")
    g.add_argument("--seed", type=int, default=0)

    g = parser.add_argument_group("verification and output")
    g.add_argument("--verifier-workers", type=positive_int, default=2)
    g.add_argument("--verifier-timeout", type=float, default=5.0, help="seconds per answer")
    g.add_argument("--output", default=None,
                   help="results JSON, replaced if it exists (default: eval-<parent>_<model dir>-<mode>.json in the "
                        "current directory, numbered -2, -3, ... rather than replacing an earlier one)")
    g.add_argument("--overwrite", action="store_true",
                   help="let the default results name replace an existing file instead of numbering a new one")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="print two results files side by side and exit")


def _parse_bench_override(text: str) -> tuple[str, dict[str, int]]:
    m = re.fullmatch(r"([^:]+):(.+)", text)
    if not m:
        raise UsageError(f"--bench '{text}': expected NAME:n=K,max_new_tokens=M")
    fields: dict[str, int] = {}
    for part in m.group(2).split(","):
        key, _, value = part.partition("=")
        if key not in ("n", "max_new_tokens") or not value.isdigit() or int(value) < 1:
            raise UsageError(f"--bench '{text}': '{part}' must be n=<int >= 1> or max_new_tokens=<int >= 1>")
        fields[key] = int(value)
    return m.group(1), fields


# Config fields whose name is not their option's (``EvalConfig.per_benchmark`` is set by ``--bench``).
_OPTION_OF_FIELD = {"per_benchmark": "--bench", "method": "--compression", "num_workers": "--verifier-workers",
                    "timeout_s": "--verifier-timeout", "default": "--n / --max-new-tokens"}
_CONFIG_FIELD = re.compile(r"\b(?:EvalConfig|BenchmarkSettings|CompressionConfig|VerifierPoolConfig)\.(\w+)")


def _as_option(field_name: str) -> str:
    return _OPTION_OF_FIELD.get(field_name, "--" + field_name.replace("_", "-"))


COMPRESSION_OPTIONS = ("budget", "window", "buffer", "scope")
"""Options that shape the KV compressor; the CompressionConfig default stands for each one not given."""


def _compression_settings(args: argparse.Namespace) -> dict:
    """The compression options given explicitly; refused without ``--compression`` (they would do nothing)."""
    from sparse_rl_megatron.compression.config import DENSE_METHOD
    from sparse_rl_megatron.compression.scorers import compressor_names

    given = {name: getattr(args, name) for name in COMPRESSION_OPTIONS if getattr(args, name) is not None}
    if given and args.compression == DENSE_METHOD:
        flags = ", ".join(f"--{name}" for name in given)
        raise UsageError(f"{flags} without --compression would run dense (the full KV cache); add --compression "
                         f"rkv (or {', '.join(n for n in compressor_names() if n != 'rkv')}), or drop " + flags)
    return given


def _pass_k(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(k) for k in text.split(",")]
    except ValueError:
        raise UsageError(f"--pass-k '{text}': expected comma-separated integers, e.g. 1,4,16") from None


def build_config(args: argparse.Namespace):
    """The ``EvalConfig`` of the parsed arguments (preset, then explicit flags, then --bench entries).

    Raises ``UsageError`` naming the option for any value the config refuses.
    """
    try:
        return _build_config(args)
    except (ValueError, KeyError) as err:  # a config dataclass refused a value: say it with the option's name
        raise UsageError(_CONFIG_FIELD.sub(lambda m: _as_option(m.group(1)), str(err))) from None


def _build_config(args: argparse.Namespace):
    from sparse_rl_megatron.compression.config import CompressionConfig
    from sparse_rl_megatron.eval.config import PAPER_PRESET, BenchmarkSettings, EvalConfig
    from sparse_rl_megatron.rewards.pool import VerifierPoolConfig

    if not args.model:
        raise UsageError("--model is required (an HF model directory or a Megatron checkpoint), unless --compare")
    benchmarks = list(BENCHMARKS) if args.benchmarks == "all" else [b for b in args.benchmarks.split(",") if b]
    preset = PAPER_PRESET if args.preset == "paper" else {}

    def pick(name):
        explicit = getattr(args, name)
        if explicit is not None:
            return explicit
        if name in ("n", "max_new_tokens"):
            return getattr(preset.get("default", None), name, _BUILTIN[name])
        return preset.get(name, _BUILTIN[name])

    default = BenchmarkSettings(n=pick("n"), max_new_tokens=pick("max_new_tokens"))
    per_benchmark: dict[str, BenchmarkSettings] = {}
    for name, s in preset.get("per_benchmark", {}).items():
        if name in benchmarks:  # a flag given explicitly applies to every benchmark, preset ones included
            per_benchmark[name] = BenchmarkSettings(
                n=args.n if args.n is not None else s.n,
                max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None else s.max_new_tokens)
    for text in args.bench:
        name, fields = _parse_bench_override(text)
        base = per_benchmark.get(name, default)
        per_benchmark[name] = BenchmarkSettings(n=fields.get("n", base.n),
                                                max_new_tokens=fields.get("max_new_tokens", base.max_new_tokens))
    compression = CompressionConfig(method=args.compression, **_compression_settings(args))
    return EvalConfig(
        model=args.model, benchmarks=benchmarks, tokenizer=args.tokenizer, data_root=args.data_root,
        limit=args.limit, input_key=args.input_key, label_key=args.label_key, template=args.template,
        engine=args.engine, compression=compression,
        temperature=pick("temperature"), top_p=pick("top_p"), default=default, per_benchmark=per_benchmark,
        pass_k=_pass_k(args.pass_k), seed=args.seed,
        dtype=args.dtype, max_batch_size=args.max_batch_size,
        verifier=VerifierPoolConfig(num_workers=args.verifier_workers, timeout_s=args.verifier_timeout),
        show_progress=not args.no_progress,
    )


def check_inputs(config, output: str | None, export_dir: str | None = None) -> None:
    """Everything the run reads and writes, checked before anything loads: the model directory, the tokenizer
    directory, every benchmark, the engine, the template, ``--output`` and ``--export-dir`` (new or empty: the
    export replaces it as a whole). Raises ``UsageError``."""
    from sparse_rl_megatron.data.templates import TEMPLATES
    from sparse_rl_megatron.rollout.engine_registry import ENGINES
    from sparse_rl_megatron.tasks import get_task, is_task_ref

    try:
        check_model_dir(config.model, "--model")
        if config.tokenizer is not None and not Path(config.tokenizer).is_dir():
            raise UserError(f"--tokenizer: {config.tokenizer} is not a directory")
        for name in config.benchmarks:
            if is_task_ref(name):  # a task built in code: its held-out split
                get_task(name)
            else:
                check_dataset(name, config.data_root, option="--benchmarks", root_option="--data-root")
        ENGINES.check(config.engine, "--engine")
        TEMPLATES.check(config.template, "--template")
        if output is not None and Path(output).is_dir():
            raise UserError(f"--output: {output} is a directory; give the results file's path")
        if export_dir is not None:
            check_new_output(export_dir, "--export-dir")
    except (UserError, ValueError) as err:  # ValueError: UnknownNameError of a registry
        raise UsageError(str(err)) from None


def results_path(args: argparse.Namespace, config) -> Path:
    """Where the results go: ``--output`` as given; else the default name, or its first free numbered variant
    unless ``--overwrite`` (an earlier run's results are never replaced unasked)."""
    from sparse_rl_megatron.eval.results import default_results_name

    if args.output:
        return Path(args.output)
    path = Path(default_results_name(config.model, config.mode()))
    return path if args.overwrite else first_free_path(path)


def run(args: argparse.Namespace) -> int:
    from sparse_rl_megatron.eval.report import print_comparison, print_results
    from sparse_rl_megatron.eval.results import read_results, write_results

    if args.compare:
        try:
            a, b = (read_results(p) for p in args.compare)
        except UserError as err:
            raise UsageError(f"--compare: {err}") from None
        pa, pb = (Path(p) for p in args.compare)
        labels = (pa.stem, pb.stem) if pa.stem != pb.stem else (str(pa), str(pb))
        print_comparison(a, b, labels=labels)
        return 0
    config = build_config(args)
    check_inputs(config, args.output, args.export_dir)
    output = results_path(args, config)
    log.info("results will be written to %s", output)
    log.info("loading torch and transformers")
    import torch

    from sparse_rl_megatron.eval.runner import run_eval

    torch.manual_seed(config.seed)
    results = run_eval(config, export_dir=args.export_dir)
    if results_path(args, config) != output:  # a run that started after this one took the name meanwhile
        output = results_path(args, config)
        log.warning("the results file name was taken while this run ran; writing %s instead", output)
    path = write_results(results, output)
    print_results(results)
    print(f"results written to {path}")
    return 0
