"""Entry point of the ``sglang.srt.plugins`` group (declared in setup.py): registers the ``sparse_kv`` backend.

SGLang loads it in every process it starts (engine, spawned schedulers, detokenizer), before the server
arguments are built. ``register()`` adds the attention backend ``sparse_kv`` (``backend.SparseKVBackend``,
configured by ``SPARSE_RL_KV_CONFIG``, see ``config``) and the scheduler hooks (``hooks``); everything is
inert unless a server selects ``attention_backend="sparse_kv"``. Without CUDA it also installs the CPU
compatibility hook of ``cpu_compat.register_hooks`` (unpinned host buffers).

Set ``SPARSE_RL_PLUGIN_TRACE=/path/file`` to have every process that loads the plugin append a line
``<pid> <process title>`` to that file: the quickest way to see that a deployment really picks it up.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

TRACE_ENV = "SPARSE_RL_PLUGIN_TRACE"
_registered = False


def _create_backend(model_runner):
    from sglang_ext.backend import SparseKVBackend
    from sglang_ext.config import config_from_env

    return SparseKVBackend(model_runner, config_from_env())


def register() -> None:
    """Called once per SGLang process by ``sglang.srt.plugins``."""
    global _registered
    _trace()
    if _registered:
        return
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from sglang_ext import cpu_compat
    from sglang_ext.config import BACKEND_NAME
    from sglang_ext.hooks import register_hooks

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(_create_backend)
    register_hooks()
    cpu_compat.register_hooks()
    _registered = True
    logger.debug("sparse-rl-megatron SGLang plugin: registered the %s attention backend", BACKEND_NAME)


def _trace() -> None:
    trace = os.environ.get(TRACE_ENV)
    if trace:
        try:
            import setproctitle

            title = setproctitle.getproctitle()
        except ImportError:
            title = "?"
        with open(trace, "a") as f:
            f.write(f"{os.getpid()} {title}\n")
