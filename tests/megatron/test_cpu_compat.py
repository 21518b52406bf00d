"""The CPU compatibility module: applied without CUDA, idempotent, and each patch W1-W13 does what it says
(W1-W9 checked in a fresh process, ``check_cpu_compat`` below, the single launch's first check; W10 in another;
W11-W13, the mixture-of-experts ones, in ``test_moe_parity.py::test_cpu_compat_moe_patches``), and what it reports
applied, armed and active is what is in effect (two more processes)."""
import subprocess

import torch

from mcore_harness import PYTHON, ROOT
from mcore_worker import mcore_check


@mcore_check("single")
def check_cpu_compat(ctx) -> None:
    """W1-W9 in a fresh process: run first in the single launch, before any learner applies the patches."""
    import megatron.core.tensor_parallel.random as mrandom
    from torch.overrides import _get_current_function_mode_stack

    from sparse_rl_megatron.learner import cpu_compat

    assert not torch.cuda.is_available()
    assert not cpu_compat.is_applied()
    real_is_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # as on a GPU machine: nothing is patched
    try:
        assert cpu_compat.apply() is False and not cpu_compat.is_applied()
        assert cpu_compat.applied_patches() == [] and torch.zeros(1).type() == "torch.FloatTensor"
    finally:
        torch.cuda.is_available = real_is_available
    assert cpu_compat.apply() is True
    modes = len(_get_current_function_mode_stack())
    assert cpu_compat.apply() is True  # idempotent: nothing is patched or entered twice
    assert len(_get_current_function_mode_stack()) == modes
    # megatron-core was imported above, before apply(): W10 did not take effect; W5 and W7 are armed, not applied
    assert cpu_compat.applied_patches() == ["W1", "W2", "W3", "W4", "W6", "W8", "W9", "W11", "W12", "W13"]
    assert cpu_compat.armed_patches() == ["W5", "W7"]
    # W1
    assert torch.cuda.current_device() == "cpu"
    # W5 is scoped: inside device_mode() (re-entrant, one mode pushed) device="cuda" keyword arguments land on
    # the CPU and t.cuda() is t; outside, torch behaves as usual (no per-op cost for the rest of the process)
    with cpu_compat.device_mode():
        with cpu_compat.device_mode():
            assert len(_get_current_function_mode_stack()) == modes + 1
            t = torch.zeros(3, device="cuda")
            assert t.cuda() is t
            assert t.device.type == "cpu" and torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert len(_get_current_function_mode_stack()) == modes + 1
    assert len(_get_current_function_mode_stack()) == modes
    try:
        torch.zeros(1, device="cuda")
        raise AssertionError("device='cuda' was rewritten outside device_mode()")
    except (RuntimeError, AssertionError) as err:
        assert "rewritten" not in str(err), err
    # W3: the default causal mask, on CPU, True above the diagonal
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    m = tutils.get_default_causal_mask(4)
    assert fused_softmax.get_default_causal_mask is tutils.get_default_causal_mask
    assert m.device.type == "cpu" and m.dtype == torch.bool
    assert torch.equal(m, torch.triu(torch.ones(4, 4, dtype=torch.bool), 1))
    # W2: the RNG tracker keeps CPU generator states; fork() draws from them and restores the outer stream
    from megatron.core import parallel_state as ps

    from sparse_rl_megatron.learner.parallel import init_model_parallel

    init_model_parallel(1, 1, seed=7)
    assert ps.model_parallel_is_initialized()
    tracker = mrandom.get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CPURNGStatesTracker"
    torch.manual_seed(123)
    outer_expected = torch.rand(3)
    torch.manual_seed(123)
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.rand(3), outer_expected), "fork() did not restore the outer CPU RNG stream"
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b), "the forked stream did not advance"
    init_model_parallel(1, 1, seed=7)  # same seed: the tracker restarts at the same state
    with mrandom.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), a)
    # W4, W8
    torch.cuda.synchronize()
    s = torch.cuda.current_stream()
    s.wait_event(None), s.wait_stream(None), s.synchronize()
    # W6: clipping scales grads by max_norm / (total + 1e-6) when that is < 1, never otherwise
    from megatron.core.optimizer import clip_grads, optimizer as moptimizer

    assert moptimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=5.0)
    torch.testing.assert_close(p.grad, torch.tensor([3.0, 4.0]) / (5.0 + 1e-6))
    p.grad = torch.tensor([0.3, 0.4])
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=0.5)
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4]))
    # W9: recompute saves "the CUDA RNG state" and restores it before re-running the forward: the CPU stream
    saved = mrandom._get_cuda_rng_state()
    first = torch.rand(4)
    mrandom._set_cuda_rng_state(saved)
    assert torch.equal(torch.rand(4), first)
    # W7: only inside the scope (within device_mode) do CPU tensors report CUDA type names
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with cpu_compat.device_mode(), cpu_compat.pretend_cuda_tensor_types():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"



def test_cpu_compat_patches(single_launch):
    single_launch.check(check_cpu_compat)


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
