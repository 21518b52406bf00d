"""``learner.offload``: the learner put to sleep between its turns on the device (``learner/offload.py``) trains bit
for bit as one that stays awake, at every layout the recipes use, TP 2, PP 2, DP 2 with the bf16 distributed
optimizer (fp32 main weights sharded), EP 2 with and without it; asleep, its device storages hold exactly what the
mode leaves (``all``: 0 bytes of weights, gradients, optimizer state, and of a reference policy's weights;
``optimizer``: the weights and gradients), measured from the tensors; woken, each part has its bytes back; a
learner asleep refuses to compute, export or save in one line. (A run with it, stopped by SIGTERM and resumed:
``tests/e2e/test_train.py``.)"""
import pytest


@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp2", "distopt_bf16"])
def test_offload_is_bit_identical_and_frees_what_it_says(pair_launch, layout):
    pair_launch.check(f"offload_{layout}")


@pytest.mark.parametrize("variant", ["ep2", "ep2_distopt"])
def test_offload_of_a_mixture_of_experts(moe_pair_launch, variant):
    moe_pair_launch.check(f"offload_{variant}")
