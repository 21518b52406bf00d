"""``mismatch/gradient.py`` (``sparse-rl gradients``): the step-0 gradient of the trainer's loss on a batch of samples,
checked against the policy gradient written out by hand on a tiny random Qwen2, and its alignment measure."""
from __future__ import annotations

import pytest
import torch

from sparse_rl_megatron.algo.config import CorrectionConfig
from sparse_rl_megatron.algo.loss import LossConfig
from sparse_rl_megatron.mismatch.gradient import align, policy_gradient, response_log_probs
from sparse_rl_megatron.models.tiny import tiny_config
from sparse_rl_megatron.rollout.sample import Sample

PAD = 0


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=64, hidden_size=32)).float().eval()


def _samples(model, rewards: list[float], sampler_shift: float = 0.0) -> list[Sample]:
    """Two groups of responses of different lengths; the sampler's log-probs are the model's own (+ a shift)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, r in enumerate(rewards):
        prompt = torch.randint(1, 64, (3 + i % 2,), generator=g).tolist()
        response = torch.randint(1, 64, (4 + i,), generator=g).tolist()
        s = Sample(prompt_ids=prompt, response_ids=response, sampler_logprobs=torch.zeros(len(response)),
                   group_id=i // 2, reward=r)
        with torch.no_grad():
            lp, _ = response_log_probs(model, [s], PAD)
        s.sampler_logprobs = lp[0] + sampler_shift
        out.append(s)
    return out


def _by_hand(model, samples) -> torch.Tensor:
    """-mean_i mean_t A_i grad log pi(y_it), A_i = r_i - its group's mean (Dr. GRPO), one sample at a time."""
    model.zero_grad(set_to_none=True)
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(float(s.reward))
    total = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        picked = logp[torch.arange(len(s.prompt_ids) - 1, ids.shape[1] - 1), torch.tensor(s.response_ids)]
        advantage = float(s.reward) - sum(groups[s.group_id]) / len(groups[s.group_id])
        total = total - advantage * picked.mean() / len(samples)
    total.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).detach().double()
    model.zero_grad(set_to_none=True)
    return grad


def test_the_gradient_is_the_policy_gradient_written_out(model):
    samples = _samples(model, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0][:4])
    correction = CorrectionConfig(mode="none", advantage_estimator="drgrpo")
    g, kept = policy_gradient(model, samples, correction, LossConfig(kl_coef=0.05), PAD)
    expected = _by_hand(model, samples)
    assert kept == 1.0
    assert float(g.norm()) > 0
    torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-7)
    # at rho = 1 Sparse-RL keeps every token with weight 1: the same gradient
    same, kept_rl = policy_gradient(model, samples, CorrectionConfig(mode="sparse_rl", advantage_estimator="drgrpo"),
                                    LossConfig(), PAD)
    torch.testing.assert_close(same, expected, rtol=1e-5, atol=1e-7)
    assert kept_rl == 1.0


def test_rejection_drops_what_the_sampler_overrated(model):
    samples = _samples(model, [1.0, 0.0, 0.0, 1.0], sampler_shift=1.0)  # rho = e^-1 < 0.5 on every token
    correction = CorrectionConfig(mode="sparse_rl", advantage_estimator="drgrpo")
    g, kept = policy_gradient(model, samples, correction, LossConfig(), PAD)
    assert kept == 0.0 and float(g.norm()) == 0.0
    naive, kept_naive = policy_gradient(model, samples, CorrectionConfig(mode="none", advantage_estimator="drgrpo"),
                                        LossConfig(), PAD)
    assert kept_naive == 1.0 and float(naive.norm()) > 0


def test_equal_rewards_give_no_gradient_and_align_measures_direction(model):
    g, _ = policy_gradient(model, _samples(model, [1.0, 1.0, 0.0, 0.0]),
                           CorrectionConfig(mode="none", advantage_estimator="drgrpo"), LossConfig(), PAD)
    assert float(g.norm()) == 0.0
    v = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert align(v, v, 1.0).cosine == pytest.approx(1.0) and align(2 * v, v, 1.0).norm_ratio == pytest.approx(2.0)
    assert align(-v, v, 1.0).cosine == pytest.approx(-1.0) and align(0 * v, v, 0.0).cosine == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--modes", "bogus"], "--modes: unknown correction mode(s) bogus; valid: custom, none"),
    (["--samples", "1"], "--samples and --reference-samples must be >= 2"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["rollout.compression.method=none"], "rollout.compression.method is dense"),
    (["--budgets", "8,x"], "--budgets: 'x' is not a positive whole number"),
])
def test_the_command_refuses_bad_options_in_one_line(argv, message, tmp_path, capsys):
    from sparse_rl_megatron.cli import main

    assert main(["gradients", "--output", str(tmp_path / "g.json"), f"run_dir={tmp_path}", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "g.json").exists() and not (tmp_path / "model").exists()


def test_a_reference_without_gradient_is_refused_in_one_line():
    from sparse_rl_megatron.mismatch.gradient_cli import check_reference
    from sparse_rl_megatron.utils.errors import UserError

    with pytest.raises(UserError, match=r"dense reference batch \(4 prompts x 4 samples\) has no gradient"):
        check_reference(torch.zeros(3, dtype=torch.float64), 4, 4)
    check_reference(torch.tensor([0.0, 1e-9], dtype=torch.float64), 4, 4)
