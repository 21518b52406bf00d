"""``learner.offload``: the learner put to sleep between its turns on the device (``learner/offload.py``) trains bit
for bit as one that stays awake, at every layout the recipes use, TP 2, PP 2, DP 2 with the bf16 distributed
optimizer (fp32 main weights sharded), EP 2 with and without it; asleep, its device storages hold exactly what the
mode leaves (``all``: 0 bytes of weights, gradients, optimizer state, and of a reference policy's weights;
``optimizer``: the weights and gradients), measured from the tensors; woken, each part has its bytes back; a
learner asleep refuses to compute, export or save in one line. (A run with it, stopped by SIGTERM and resumed:
``tests/e2e/test_train.py``.)"""
import pytest

import mcore_checks as C
from mcore_harness import tp_pp
from mcore_worker import mcore_check

OFFLOAD_LAYOUTS = ["tp2pp1", "tp1pp2"]


@mcore_check("pair", params=[{"at": at} for at in OFFLOAD_LAYOUTS])
def check_offload(ctx, at):
    C.check_offload_bit_identical(ctx.refs["qwen2_untied"], *tp_pp(at))


@mcore_check("pair")
def check_offload_distopt_bf16(ctx):
    C.check_offload_bit_identical(ctx.refs["qwen2_untied"], 1, 1, distributed_optimizer=True,
                                  params_dtype="bfloat16")


@pytest.mark.parametrize("layout", OFFLOAD_LAYOUTS + ["distopt_bf16"])
def test_offload_is_bit_identical_and_frees_what_it_says(pair_launch, layout):
    if layout == "distopt_bf16":
        pair_launch.check(check_offload_distopt_bf16)
    else:
        pair_launch.check(check_offload, at=layout)


@mcore_check("moe_pair")
def check_offload_ep2(ctx):
    """EP 2 over DP 2 (expert parallel), without the distributed optimizer."""
    from sparse_rl_megatron.learner.config import MoESettings

    C.check_offload_bit_identical(ctx.refs["qwen3_moe"], 1, 1, expert_parallel_size=2, expert_tensor_parallel_size=1,
                                  moe=MoESettings(aux_loss_coeff=0.0))


@mcore_check("moe_pair")
def check_offload_ep2_distopt(ctx):
    """EP 2 over DP 2 with the distributed optimizer (expert shards)."""
    from sparse_rl_megatron.learner.config import MoESettings

    C.check_offload_bit_identical(ctx.refs["qwen3_moe"], 1, 1, expert_parallel_size=2, expert_tensor_parallel_size=1,
                                  distributed_optimizer=True, moe=MoESettings(aux_loss_coeff=0.0))


@pytest.mark.parametrize("variant", ["ep2", "ep2_distopt"])
def test_offload_of_a_mixture_of_experts(moe_pair_launch, variant):
    moe_pair_launch.check(check_offload_ep2_distopt if variant == "ep2_distopt" else check_offload_ep2)
