"""The CPU compatibility module: applied without CUDA, idempotent, and each patch W1-W13 does what it says
(W1-W9 checked in a fresh process, ``workers/w_single.py::check_cpu_compat``; W10 in another; W11-W13, the
mixture-of-experts ones, in ``test_moe_parity.py::test_cpu_compat_moe_patches``), and what it reports applied,
armed and active is what is in effect (two more processes)."""
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


def test_megatron_imported_by_apply_leaves_torch_inductor_out_and_compiles_on_first_call():
    """W10: ``apply()``'s import of megatron-core defers its fusions' ``torch.compile`` (inductor never imported);
    ``torch.compile`` is torch's again afterwards; a deferred function compiles when first called, a deferred method
    binds its instance, a deferred megatron function pickles by reference, and a module given to the deferring
    ``torch.compile`` is compiled as usual."""
    code = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "from sparse_rl_megatron.learner import cpu_compat\n"
        "assert cpu_compat.apply() is True and 'W10' in cpu_compat.applied_patches()\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules, 'inductor imported'\n"
        "assert torch.compile is real\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_gelu\n"
        "assert isinstance(fused_bias_gelu.bias_gelu, cpu_compat.CompileOnFirstCall)\n"
        "assert not fused_bias_gelu.bias_gelu.compiled and fused_bias_gelu.bias_gelu.__name__ == 'bias_gelu'\n"
        "with cpu_compat.compile_on_first_call():\n"
        "    f = torch.compile(lambda x: x * 2 + 1, backend='eager')\n"
        "    g = torch.compile(backend='eager')(lambda x: x - 1)\n"
        "    m = torch.compile(torch.nn.Identity(), backend='eager')\n"
        "assert isinstance(f, cpu_compat.CompileOnFirstCall) and not f.compiled\n"
        "x = torch.arange(3.0)\n"
        "assert torch.equal(f(x), x * 2 + 1) and f.compiled and torch.equal(g(x), x - 1)\n"
        "assert not isinstance(m, cpu_compat.CompileOnFirstCall) and torch.equal(m(x), x)\n"
        "with cpu_compat.compile_on_first_call():\n"
        "    class Norm:\n"
        "        scale = 3.0\n"
        "        @torch.compile(backend='eager')\n"
        "        def apply(self, x):\n"
        "            return x * self.scale\n"
        "assert torch.equal(Norm().apply(x), x * 3) and isinstance(Norm.apply, cpu_compat.CompileOnFirstCall)\n"
        "import pickle\n"
        "assert pickle.loads(pickle.dumps(fused_bias_gelu.bias_gelu)) is fused_bias_gelu.bias_gelu\n"
        "print('deferred')\n"
    )
    proc = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "deferred" in proc.stdout, proc.stderr[-3000:]


def test_applied_patches_name_what_is_in_effect_and_armed_ones_what_waits_for_its_block():
    """``applied_patches`` names the patches in effect: never the scoped W5 and W7 (``armed_patches``, in effect
    only inside their blocks, which ``active_patches`` then names), and W10 only when ``apply()``'s import of
    megatron-core was its first: after an earlier import it changed nothing."""
    code = (
        "import sys\n"
        "from sparse_rl_megatron.learner import cpu_compat\n"
        "first = sys.argv[1] == 'first'\n"
        "if not first:\n"
        "    import megatron.core.tensor_parallel\n"
        "assert cpu_compat.apply() is True\n"
        "base = ['W1', 'W2', 'W3', 'W4', 'W6', 'W8', 'W9', 'W11', 'W12', 'W13']\n"
        "applied = sorted(base + ['W10'] * first, key=lambda n: int(n[1:]))\n"
        "assert cpu_compat.applied_patches() == applied, cpu_compat.applied_patches()\n"
        "assert cpu_compat.armed_patches() == ['W5', 'W7'] and cpu_compat.active_patches() == applied\n"
        "with cpu_compat.device_mode():\n"
        "    assert cpu_compat.active_patches() == sorted(applied + ['W5'], key=lambda n: int(n[1:]))\n"
        "    with cpu_compat.pretend_cuda_tensor_types():\n"
        "        assert cpu_compat.active_patches() == sorted(applied + ['W5', 'W7'], key=lambda n: int(n[1:]))\n"
        "assert cpu_compat.active_patches() == applied\n"
        "print('truthful')\n"
    )
    for when in ("first", "after"):
        proc = subprocess.run([PYTHON, "-c", code, when], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "truthful" in proc.stdout, (when, proc.stderr[-3000:])
