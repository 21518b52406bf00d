"""`sparse-rl --help`, `sparse-rl eval --help` and `sparse-rl convert --help` import none of the heavy
frameworks (what made them take 6-9 s), in a fresh interpreter."""
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "megatron", "transformers", "sglang", "numpy")
_PROBE = """
import json, sys
from sparse_rl_megatron.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(%r))))
""" % (HEAVY,)


@pytest.mark.parametrize("argv", [["--help"], ["eval", "--help"], ["convert", "--help"]], ids=" ".join)
def test_help_imports_no_framework(argv):
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *help_lines, loaded = proc.stdout.strip().splitlines()
    assert help_lines[0].startswith("usage: sparse-rl")
    assert json.loads(loaded) == []
