"""Files that appear whole or not at all: written to ``<name>.tmp``, flushed to disk, then renamed over the target."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """``write(f)`` into ``<path>.tmp``, fsync, then rename it to ``path`` (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """``obj`` as indented JSON (and a newline), atomically."""
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))
