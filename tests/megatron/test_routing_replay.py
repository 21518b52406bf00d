"""Routing replay (R3, ``learner.moe.routing_replay``) in the learner against the HF engine: the sampler's recorded
experts, or forced other ones, drive the dense recompute and the training forward (the checks below, run by ``workers/w_replay.py`` in one
process, both tiny MoE families)."""
import pytest
import torch

from mcore_harness import launch
from mcore_worker import expect, mcore_check

FAMILIES = ("qwen3_moe", "qwen2_moe")
PER_FAMILY = [{"family": f} for f in FAMILIES]
PROMPTS = [[5, 17, 33, 8, 41, 99, 7], [12, 250, 3, 64, 18], [77, 6, 301, 45, 9, 13, 201, 88]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def replay_launch(tmp_path_factory):
    work = tmp_path_factory.mktemp("replay")
    return launch("w_replay.py", 1, [str(work)], work / "results", timeout=400)


# The checks of one family run together (group_by="family"), each on what the one before left in ctx.states.
@mcore_check("replay", params=PER_FAMILY)
def check_setup(ctx, family):
    from sparse_rl_megatron.learner import Learner
    from sparse_rl_megatron.learner.config import LearnerConfig, MoESettings, OptimConfig
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    state = ctx.states[family]
    path = save_tiny_hf_checkpoint(ctx.work / family, family, seed=3, init_std=0.2, num_layers=2,
                                   vocab_size=512, num_experts=4, experts_per_token=2)
    engine = HFRolloutEngine(path, show_progress=False, record_routing=True)
    samples = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=NEW_TOKENS, seed=7, ignore_eos=True))
    cfg = LearnerConfig(model_path=str(path), optim=OptimConfig(lr=0.0),
                        moe=MoESettings(aux_loss_coeff=0.0, routing_replay=True))
    lrn = Learner(cfg)
    assert lrn.routing_replay and "routing_replay=sampler" in lrn.describe(), lrn.describe()
    state.update(path=path, engine=engine, samples=samples, lrn=lrn)



@mcore_check("replay", params=PER_FAMILY)
def check_own(ctx, family):
    from numerics import assert_logprobs_within, hf_logprob_tolerance
    from sparse_rl_megatron.learner import SequenceBatch

    state = ctx.states[family]
    samples, lrn = state["samples"], state["lrn"]
    plain = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    with_routes = SequenceBatch(plain.prompts, plain.responses, [s.routed_experts for s in samples])
    got, want = lrn.logprobs(with_routes), lrn.logprobs(plain)
    # a token the two routers sent to different experts (a near-tie) would move by far more than this
    tol = hf_logprob_tolerance(state["engine"].model, [s.prompt_ids for s in samples], [s.response_ids for s in samples])
    assert_logprobs_within(got, want, tol, "learner replaying the HF engine's own experts vs unreplayed")



@mcore_check("replay", params=PER_FAMILY)
def check_forced(ctx, family):
    from numerics import assert_logprobs_within, hf_logprob_tolerance
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.learner import SequenceBatch

    state = ctx.states[family]
    samples, lrn, engine = state["samples"], state["lrn"], state["engine"]
    experts = engine.model.config.num_experts
    shifted = [(s.routed_experts[len(s.prompt_ids):].long() + 1) % experts for s in samples]
    ref = engine.teacher_forced([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                compression=CompressionConfig(), routing=shifted)
    for s, r, sh in zip(samples, ref, shifted):
        assert torch.equal(r.routed_experts[len(s.prompt_ids):].long(), sh)
    batch = SequenceBatch([torch.tensor(s.prompt_ids) for s in samples],
                          [torch.tensor(s.response_ids) for s in samples], [r.routed_experts for r in ref])
    want = torch.nn.utils.rnn.pad_sequence([r.sampler_logprobs for r in ref], batch_first=True)
    tol = hf_logprob_tolerance(engine.model, [s.prompt_ids for s in samples], [s.response_ids for s in samples])
    got = lrn.logprobs(batch)
    assert_logprobs_within(got, want, tol, "learner replaying shifted experts vs HF with them forced")
    plain = lrn.logprobs(SequenceBatch(batch.prompts, batch.responses))
    gap = float((plain - want).abs().max())
    expect(gap > 100 * tol, f"the unreplayed learner is only {gap:.3g} from the forced routing (tol {tol:.3g})")
    state["forced_batch"] = batch



@mcore_check("replay", params=PER_FAMILY)
def check_train(ctx, family):
    from sparse_rl_megatron.algo import CorrectionConfig, prepare_correction
    from sparse_rl_megatron.learner import SequenceBatch
    from sparse_rl_megatron.learner.train_step import TrainBatch

    state = ctx.states[family]
    lrn, batch = state["lrn"], state["forced_batch"]
    old = lrn.logprobs(batch)
    mask = batch.response_mask()
    prepared = prepare_correction(old, old, mask, torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0]),
                                  CorrectionConfig(mode="none"))
    router = lrn.model.decoder.layers[0].mlp.router.weight
    before = router.detach().clone()
    metrics = lrn.train_step(TrainBatch(batch, prepared))
    expect(abs(metrics["loss/ppo_kl"]) < 1e-6 and metrics["loss/clip_frac"] == 0.0,
           f"replayed training forward vs replayed recompute: ppo_kl {metrics['loss/ppo_kl']:.3g}, "
           f"clip_frac {metrics['loss/clip_frac']}")
    grad = getattr(router, "main_grad", None)
    expect(grad is not None and float(grad.abs().sum()) > 0, "the router got no gradient under replay")
    expect(torch.equal(router.detach(), before), "lr 0 moved the router")
    plain = lrn.train_step(TrainBatch(SequenceBatch(batch.prompts, batch.responses), prepared))
    expect(abs(plain["loss/ppo_kl"]) > 1e-4,
           f"dropping the routes from the training batch left ppo_kl at {plain['loss/ppo_kl']:.3g}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("check", [check_setup, check_own, check_forced, check_train],
                         ids=["setup", "own", "forced", "train"])
def test_routing_replay(replay_launch, family, check):
    replay_launch.check(check, family=family)
