"""Entry point of the ``sglang.srt.plugins`` group (declared in setup.py).

SGLang loads it in every process it starts (engine, spawned schedulers, detokenizer), so anything the
KV-eviction extension must register (attention backend, allocator hooks) is registered from here.
For now it registers nothing: the compressed-KV attention backend is a later piece of work.

Set ``SPARSE_RL_PLUGIN_TRACE=/path/file`` to have every process that loads the plugin append a line
``<pid> <process title>`` to that file: the quickest way to see that a deployment really picks it up.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

TRACE_ENV = "SPARSE_RL_PLUGIN_TRACE"


def register() -> None:
    """Called once per SGLang process by ``sglang.srt.plugins``."""
    logger.debug("sparse-rl-megatron SGLang plugin loaded (nothing to register yet)")
    trace = os.environ.get(TRACE_ENV)
    if trace:
        try:
            import setproctitle

            title = setproctitle.getproctitle()
        except ImportError:
            title = "?"
        with open(trace, "a") as f:
            f.write(f"{os.getpid()} {title}\n")
