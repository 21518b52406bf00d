"""The correction-mode registry: a mode is a registered function, chosen by name, declaring what it needs."""
import pytest
import torch

from sparse_rl_megatron.algo import CorrectionConfig, prepare_correction
from sparse_rl_megatron.algo.modes import (
    CORRECTION_MODES, Correction, CorrectionInputs, register_correction_mode, reject_and_reweight,
)
from sparse_rl_megatron.algo.slime_hook import config_from_args
from sparse_rl_megatron.utils.registry import UnknownNameError


@pytest.fixture
def scratch_mode():
    """Registers ``keep_first_token`` for one test and removes it after (the registry is process-wide)."""

    @register_correction_mode("keep_first_token", needs_sampler=False)
    def keep_first_token(inputs: CorrectionInputs, config: CorrectionConfig) -> Correction:
        mask = inputs.response_mask & (torch.arange(inputs.response_mask.shape[1]) == 0)
        return Correction(mask, torch.zeros(mask.shape[0], dtype=torch.bool), mask.to(inputs.log_rho.dtype))

    yield "keep_first_token"
    del CORRECTION_MODES._items["keep_first_token"]


def test_sparse_rl_is_reject_and_reweight():
    assert CORRECTION_MODES.get("sparse_rl").fn is reject_and_reweight
    assert CORRECTION_MODES.get("sparse_rl").rejects and not CORRECTION_MODES.get("reweight_only").rejects


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="correction mode 'sparse_rl' is already registered"):
        register_correction_mode("sparse_rl")(reject_and_reweight)


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(UnknownNameError, match="unknown correction mode 'sparse'; valid names: custom, none, "
                                               "rejection_only, reweight_only, sparse_rl"):
        CORRECTION_MODES.get("sparse")


def test_a_registered_mode_is_a_config_choice_and_runs(scratch_mode):
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    prepared = prepare_correction(old, None, mask, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                  CorrectionConfig(mode=scratch_mode))
    assert prepared.loss_mask.tolist() == [[True, False, False], [True, False, False]]
    assert prepared.weights.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_the_hook_rules_follow_what_a_mode_declares(scratch_mode):
    with pytest.raises(ValueError, match=r"hook is only used with mode='custom', but mode='keep_first_token'"):
        CorrectionConfig(mode=scratch_mode, hook="a.b.c")
    with pytest.raises(ValueError, match="not allowed inside"):
        config_from_args(type("Args", (), {"sparse_rl_mode": "custom", "sparse_rl_hook": "a.b.c"})())
