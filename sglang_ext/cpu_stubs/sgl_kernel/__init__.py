"""Stand-in for ``sgl_kernel`` on machines without CUDA (no CPU build of it exists on PyPI).

SGLang's CPU engine imports a handful of names from ``sgl_kernel`` at module level but, with
page_size=1 and no speculative decoding, never calls them. Every attribute here is a function that
raises if it is ever called, so a code path that really needs a kernel fails loudly instead of silently.
Put on ``sys.path`` / ``PYTHONPATH`` only by ``sglang_ext.cpu_compat`` and only when CUDA is absent.
"""

IS_SPARSE_RL_STUB = True


class SglKernelStubCalled(RuntimeError):
    """A function of the stand-in sgl_kernel was called: this SGLang path needs the real kernel."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing_kernel(*args, **kwargs):
        raise SglKernelStubCalled(
            f"sgl_kernel.{name} was called, but this is sparse-rl-megatron's CPU stand-in for sgl_kernel "
            "(no CPU build exists). Use page_size=1 and no speculative decoding on CPU, or run on a GPU."
        )

    _missing_kernel.__name__ = name
    _missing_kernel.__qualname__ = name
    return _missing_kernel
