"""Start an SGLang HTTP server with the sparse_kv plugin: ``python -m sglang_ext.launch_server ...``.

    python -m sglang_ext.launch_server --sparse-kv-config '{"compression": {"method": "rkv", "budget": 512}}' \\
        --model-path Qwen/Qwen2.5-1.5B-Instruct --port 30000 [any other sglang server flag]

``--sparse-kv-config`` takes JSON or a .json/.yaml file (fields of ``sglang_ext.config.SparseKVConfig``) and is
validated before anything starts. The launcher then sets ``SPARSE_RL_KV_CONFIG`` and
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (T=1 log-probs, the convention of ``SGLangRolloutEngine``), adds the
flags the plugin needs unless given (``--attention-backend sparse_kv``, ``--page-size 1``, CUDA graphs
off; on a machine without CUDA the CPU engine's ``--device cpu --sampling-backend pytorch``, a 65536-token
pool and the stand-in ``sgl_kernel``), and hands over to SGLang's own ``sglang.launch_server``. An attention
backend other than sparse_kv (``--attention-backend``, ``--prefill-attention-backend``,
``--decode-attention-backend``) is refused in one line before SGLang is imported: the kernels under the plugin are
the config's ``inner_backend``.
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

from sglang_ext.config import BACKEND_NAME, CONFIG_ENV, parse_config
from sglang_ext.cpu_compat import CPU_DEFAULT_POOL_TOKENS, CPU_DEFAULT_RUNNING_REQUESTS
from sglang_ext.refusals import BACKEND_FLAGS, refuse_other_backend
from sparse_rl_megatron.utils.config_io import ConfigError


def server_argv(argv: list[str], *, on_cpu: bool) -> list[str]:
    """SGLang's flags with the plugin's requirements added where the user did not set them."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = list(argv)

    def add(flag: str, *values: str) -> None:
        if flag not in given:
            out.extend([flag, *values])

    add("--attention-backend", BACKEND_NAME)
    add("--page-size", "1")
    add("--cuda-graph-backend-decode", "disabled")
    add("--cuda-graph-backend-prefill", "disabled")
    if on_cpu:
        add("--device", "cpu")
        add("--sampling-backend", "pytorch")
        add("--max-total-tokens", str(CPU_DEFAULT_POOL_TOKENS))  # SGLang would size the pool from a share of RAM
        add("--max-running-requests", str(CPU_DEFAULT_RUNNING_REQUESTS))  # the plugin reserves per row at start
    return out


def backend_flags(argv: list[str]) -> dict[str, str | None]:
    """The attention-backend fields (``refusals.BACKEND_FLAGS``) as SGLang's command line ``argv`` sets them
    (``--flag value`` or ``--flag=value``; the last one wins, as in argparse), None where absent."""
    flags: dict[str, str | None] = dict.fromkeys(BACKEND_FLAGS)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        field = name[2:].replace("-", "_") if name.startswith("--") else ""
        if field in flags:
            flags[field] = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return flags


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--sparse-kv-config", default=os.environ.get(CONFIG_ENV, ""),
                        help="sparse_kv settings: JSON or a .json/.yaml file (default: $SPARSE_RL_KV_CONFIG)")
    known, rest = parser.parse_known_args(argv)
    try:
        config = parse_config(known.sparse_kv_config, "--sparse-kv-config") if known.sparse_kv_config else None
        # before SGLang is imported: the server this launches serves through sparse_kv or not at all
        refuse_other_backend(SimpleNamespace(**backend_flags(server_argv(rest, on_cpu=False))), resolved=False)
    except ConfigError as err:
        sys.exit(f"error: {err}")
    from sglang_ext import cpu_compat

    on_cpu = cpu_compat.apply()
    if config is not None:
        os.environ[CONFIG_ENV] = config.to_json()
    os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(server_argv(rest, on_cpu=on_cpu))
    try:
        run_server(server_args)
    except ConfigError as err:
        sys.exit(f"error: {err}")
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
