"""The CPU-expected megatron-core warnings are silenced, and only those: the same message from another module,
and another message from megatron-core, still show."""
import warnings

from sparse_rl_megatron.utils.quiet import EXPECTED_CPU_WARNINGS, silence_expected_cpu_warnings


def _shown(message: str, module: str) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_expected_cpu_warnings()
        silence_expected_cpu_warnings()  # idempotent
        warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
    return len(caught) == 1


def test_only_the_expected_megatron_warnings_are_silenced():
    te = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    assert not _shown(te, "megatron.core.optimizer")
    assert not _shown("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends")
    assert _shown(te, "my_project.optim")  # the same words from elsewhere
    assert _shown("Megatron-FSDP is experimental", "megatron.core.distributed")  # another megatron warning
    assert _shown("Apex is not installed. Falling back to Torch Norm", "megatron_lm_fork.core")
    assert len(EXPECTED_CPU_WARNINGS) == 2 and all(why for _, why in EXPECTED_CPU_WARNINGS)
