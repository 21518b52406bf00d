"""The megatron tier's tolerances (``mcore_spec``, from ``tests/numerics.py``) still catch what its checks are
there for: a seeded defect of each family, applied to the HF reference model, exceeds the family's bound."""
from __future__ import annotations

import copy

import pytest
import torch

import mcore_spec as spec
import numerics
from sparse_rl_megatron.models.tiny import build_tiny_model


def _model(name: str):
    kw = dict(spec.MODELS[name])
    return build_tiny_model(kw.pop("family"), seed=spec.SEED, init_std=spec.INIT_STD, **kw)


@pytest.mark.parametrize("name", list(spec.MODELS))
def test_a_swapped_tensor_parallel_shard_exceeds_the_logits_bound(name):
    """The two halves of layer 0's query projection swapped (a TP=2 shard loaded on the wrong rank)."""
    model = _model(name)
    ids = spec.parity_ids()
    with torch.no_grad():
        want = model(ids).logits
        bad = copy.deepcopy(model)
        w = bad.model.layers[0].self_attn.q_proj.weight
        w.copy_(torch.cat(w.chunk(2, dim=0)[::-1]))
        got = bad(ids).logits
    tol = spec.logits_atol(name, want.abs().max().item())
    assert (got - want).abs().max().item() > 10 * tol
    lp_tol = spec.logprob_atol(name, want.abs().max().item())
    assert (got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item() > 10 * lp_tol


@pytest.mark.parametrize("name", list(spec.MODELS))
def test_an_off_by_one_chunk_exceeds_the_chunked_head_bound(name):
    """A chunked head that scores one chunk's tokens with the hidden states one position off."""
    model = _model(name)
    hf = {k: v for k, v in model.state_dict().items()}
    with torch.no_grad():
        hidden = model.model(spec.parity_ids()).last_hidden_state[0]  # [24, H]
        head = model.lm_head.weight
        full = (hidden @ head.T).log_softmax(-1)
        shifted = hidden.clone()
        shifted[5:10] = hidden[6:11]  # chunk 2 of 5 tokens, one position late
        chunked = (shifted @ head.T).log_softmax(-1)
    assert (chunked - full).abs().max().item() > 10 * spec.chunk_atol(hf, name)


def test_a_wrong_sign_or_scale_of_the_gradient_exceeds_the_step_bound():
    """One AdamW step with the gradient's sign flipped, or with eps dwarfed by a 1e-6 scaled gradient (a
    gradient divided by the wrong normaliser): weights move away from the right step by far more than
    ``STEP_ATOL``; a gradient with fp32-rounding noise stays within it."""
    torch.manual_seed(0)
    w0 = torch.randn(1000)
    g = torch.randn(1000)

    def step(grad):
        p = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([p], lr=spec.LR, betas=spec.TRAIN["betas"], eps=spec.TRAIN["eps"],
                                weight_decay=spec.TRAIN["weight_decay"])
        p.grad = grad.clone()
        opt.step()
        return p.detach()

    right = step(g)
    noisy = step(g * (1 + numerics.SAFETY * numerics.U_FP32 * torch.randn(1000)))
    assert (noisy - right).abs().max().item() <= spec.STEP_ATOL
    assert (step(-g) - right).abs().max().item() > 10 * spec.STEP_ATOL
    assert (step(g * 1e-6) - right).abs().max().item() > 10 * spec.STEP_ATOL


def test_the_error_model_is_what_its_formulas_say():
    assert numerics.gamma(10) == pytest.approx(10 * 2.0 ** -24, rel=1e-6)
    with pytest.raises(ValueError, match="K \\* u >= 1"):
        numerics.gamma(300, numerics.U_BF16)
    # the flip allowance of the engine-shard tests: ~500 tokens whose log-probs move by ~1e-6
    assert numerics.flip_probability(500, 1e-6) == pytest.approx(1e-3, rel=1e-3)
    # two real summation orders of K fp32 terms stay within the bound
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    forward, backward = x.sum().item(), x.flip(0).cumsum(0)[-1].item()
    assert abs(forward - backward) <= numerics.reorder_bound(4096, x.abs().sum().item())
