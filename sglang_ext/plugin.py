"""Entry point of the ``sglang.srt.plugins`` group (declared in setup.py).

SGLang loads it in every process it starts (engine, spawned schedulers, detokenizer), so anything the
KV-eviction extension must register (attention backend, allocator hooks) is registered from here.
For now it registers nothing: the compressed-KV attention backend is a later piece of work.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

REGISTERED: list[str] = []
"""Names of what ``register`` installed in this process (empty until the eviction backend exists)."""


def register() -> None:
    """Called once per SGLang process by ``sglang.srt.plugins``."""
    logger.debug("sparse-rl-megatron SGLang plugin loaded (nothing to register yet)")
