"""The warnings a CPU-only run is expected to raise, silenced in one place: ``silence_expected_cpu_warnings``.

``learner.cpu_compat.apply()`` calls it on a machine without CUDA, before megatron-core is first imported.
Each filter matches one message from megatron-core modules only; every other warning (from megatron-core or
anywhere else, and these same messages from elsewhere) is shown as before. The list, and why each is expected:
"""
from __future__ import annotations

import re
import warnings

EXPECTED_CPU_WARNINGS: tuple[tuple[str, str], ...] = (
    ("Transformer Engine and Apex are not installed. Falling back to",
     "four import-time warnings (optimizer, optimizer.optimizer, optimizer.clip_grads, megatron_fsdp): the CPU "
     "recipe installs neither package (README, set-up); megatron-core's local multi-tensor and torch optimizer "
     "fall-backs are the code the CPU tests check"),
    ("Apex is not installed. Falling back to Torch Norm",
     "two import-time warnings (models.backends, gpt_layer_specs): same reason; the learner builds the local "
     "layer spec on CPU, whose norm is torch's"),
)
"""(start of the message, why it is expected on CPU)."""
MEGATRON_MODULES = r"megatron\.core(\.|$)"
"""The modules whose warnings the filters apply to (``warnings.filterwarnings(module=...)``)."""


def silence_expected_cpu_warnings() -> None:
    """Ignore the warnings of ``EXPECTED_CPU_WARNINGS`` (from megatron-core only). Idempotent: the warnings
    module replaces an identical filter instead of adding it twice."""
    for message, _why in EXPECTED_CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning, module=MEGATRON_MODULES)
