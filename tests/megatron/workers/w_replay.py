"""Routing replay (R3) in the learner, one process: a tiny Qwen3-MoE and a tiny Qwen2-MoE (shared expert, top-k of
the full softmax), fp32, the HF reference engine as the sampler.

usage: w_replay.py RESULT_DIR WORK_DIR

Checks per model:
- ``own_<m>``: replaying the experts the HF engine itself picks (its ``generate`` records them at prefill and decode)
  leaves the learner's log-probs where its own routers put them, within the float error model's bound (a token the
  two routers sent to different experts would move by orders of magnitude more).
- ``forced_<m>``: replaying *other* experts (each fed response token's HF choice shifted by one expert) gives the
  log-probs the HF engine computes with those experts forced (``teacher_forced(routing=...)``), within the float
  error model's bound, while the unreplayed learner is far from them: the recompute follows the given routes.
- ``train_<m>``: the training forward replays the same routes as the recompute: with pi_old from the replayed
  recompute and lr 0, the step's ratio is 1 (``loss/ppo_kl`` ~ 0, nothing clipped) and the router still gets a
  gradient; with the same pi_old but the routes dropped from the training batch the ratio moves.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # tests/ (numerics)

PROMPTS = [[5, 17, 33, 8, 41, 99, 7], [12, 250, 3, 64, 18], [77, 6, 301, 45, 9, 13, 201, 88]]
NEW_TOKENS = 10


def main() -> None:
    from mcore_worker import expect, run_checks
    from numerics import assert_logprobs_within, hf_logprob_tolerance

    from sparse_rl_megatron.learner import Learner, SequenceBatch
    from sparse_rl_megatron.learner.config import LearnerConfig, MoESettings, OptimConfig
    from sparse_rl_megatron.learner.train_step import TrainBatch
    from sparse_rl_megatron.algo import CorrectionConfig, prepare_correction
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    result_dir, work = sys.argv[1], Path(sys.argv[2])
    checks = []
    for family in ("qwen3_moe", "qwen2_moe"):
        state: dict = {}

        def setup(family=family, state=state):
            path = save_tiny_hf_checkpoint(work / family, family, seed=3, init_std=0.2, num_layers=2,
                                           vocab_size=512, num_experts=4, experts_per_token=2)
            engine = HFRolloutEngine(path, show_progress=False, record_routing=True)
            samples = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=NEW_TOKENS, seed=7, ignore_eos=True))
            cfg = LearnerConfig(model_path=str(path), optim=OptimConfig(lr=0.0),
                                moe=MoESettings(aux_loss_coeff=0.0, routing_replay=True))
            lrn = Learner(cfg)
            assert lrn.routing_replay and "routing_replay=sampler" in lrn.describe(), lrn.describe()
            state.update(path=path, engine=engine, samples=samples, lrn=lrn)

        def own(state=state):
            samples, lrn = state["samples"], state["lrn"]
            plain = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
            with_routes = SequenceBatch(plain.prompts, plain.responses, [s.routed_experts for s in samples])
            got, want = lrn.logprobs(with_routes), lrn.logprobs(plain)
            # a token the two routers sent to different experts (a near-tie) would move by far more than this
            tol = hf_logprob_tolerance(state["engine"].model, [s.prompt_ids for s in samples], [s.response_ids for s in samples])
            assert_logprobs_within(got, want, tol, "learner replaying the HF engine's own experts vs unreplayed")

        def forced(state=state):
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

        def train(state=state):
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

        checks += [(f"setup_{family}", setup), (f"own_{family}", own), (f"forced_{family}", forced),
                   (f"train_{family}", train)]
    run_checks(checks, result_dir)


if __name__ == "__main__":
    main()
