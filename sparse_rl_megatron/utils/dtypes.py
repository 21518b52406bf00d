"""The dtype names every command accepts (``--dtype``), without importing torch (``--help`` stays instant)."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""Names of the parameter / compute dtypes: ``getattr(torch, name)`` is the torch dtype."""
