"""The CPU compatibility module: applied without CUDA, idempotent, and each patch W1-W9 does what it says
(checked in a fresh process: ``workers/w_single.py::check_cpu_compat``)."""
import subprocess

from mcore_harness import PYTHON, ROOT


def test_cpu_compat_patches(single_launch):
    single_launch.check("cpu_compat")


def test_not_applied_on_import():
    """Importing the learner package patches nothing; building a Learner (or calling apply()) does."""
    code = (
        "import torch, sparse_rl_megatron.learner as L\n"
        "from sparse_rl_megatron.learner import cpu_compat\n"
        "assert not cpu_compat.is_applied()\n"
        "assert torch.zeros(1, device='cpu').type() == 'torch.FloatTensor'\n"
        "print('clean')\n"
    )
    proc = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr
