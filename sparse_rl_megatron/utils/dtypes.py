"""The dtype names every command accepts (``--dtype``), without importing torch (``--help`` stays instant)."""
from typing import Literal, get_args

DtypeName = Literal["float32", "bfloat16", "float16"]
"""A parameter / compute dtype by name: ``getattr(torch, name)`` is the torch dtype."""
DTYPE_NAMES: tuple[str, ...] = get_args(DtypeName)
"""Names of the parameter / compute dtypes."""
