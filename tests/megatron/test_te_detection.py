"""Transformer Engine detection follows megatron-core's own ``HAVE_TE``: a TE that is installed but cannot be
imported (e.g. built against another CUDA) is not used; ``auto`` falls back to the local spec with a warning
and ``te`` is refused naming the cause. Run in a fresh process with a broken ``transformer_engine`` package on
the path and ``torch.cuda.is_available`` answering True (as on a GPU machine)."""
import os
import subprocess

from mcore_harness import PYTHON, ROOT

# The Python package is there, the CUDA-specific core it loads is not (as when the TE wheels for another CUDA
# were installed): `import transformer_engine` raises ModuleNotFoundError, which megatron-core catches.
BROKEN_TE = "import transformer_engine_cu12  # the CUDA 12 core library package\n"

PROBE = r'''
import warnings
import torch
torch.cuda.is_available = lambda: True  # a GPU machine, as far as the spec choice is concerned
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from sparse_rl_megatron.learner import model_provider as mp

assert gpt_layer_specs.HAVE_TE is False
assert not mp.te_available(), "te_available() says yes while megatron-core could not import TE"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    spec = mp.layer_spec("auto")
assert spec.submodules.input_layernorm is WrappedTorchNorm, spec  # the local spec
text = " ".join(str(w.message) for w in caught)
assert "installed but megatron-core cannot import it" in text and "using the local megatron-core spec" in text, text
try:
    mp.layer_spec("te")
    raise AssertionError("layer_spec('te') accepted a broken Transformer Engine")
except RuntimeError as err:
    assert "layer_spec='te' needs Transformer Engine" in str(err) and "cannot import it" in str(err), err
print("probe ok")
'''


def test_broken_te_install_falls_back_to_local_spec(tmp_path):
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text(BROKEN_TE)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([PYTHON, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "probe ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
