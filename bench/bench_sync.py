"""What the trainer adds per rollout step around the learner: weight sync (by bucket size) and the log-prob probe,
side by side with one corrected-GRPO train step and one rollout of the same model.

A random Qwen2 (HF directory in a temp dir) is loaded by the Megatron ``Learner`` (TP 1, one process) and by the
HF reference engine; each operation runs ``--iters`` times and the fastest CPU time of this process is kept
(robust to other jobs on a shared machine; wall time is shown too).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sync.py

Not a test: timings on a shared 2-core machine are noisy.
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rows", type=int, default=16, help="sequences of the train step and the rollout")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--buckets-mb", type=int, nargs="+", default=[1, 16, 512])
    p.add_argument("--probe-tokens", type=int, default=32)
    p.add_argument("--iters", type=int, default=3)
    return p.parse_args(argv)


def timed(fn, iters: int) -> tuple[float, float]:
    """(fastest CPU seconds, its wall seconds) of ``iters`` calls."""
    best = (float("inf"), 0.0)
    for _ in range(iters):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        best = min(best, (time.process_time() - c0, time.perf_counter() - w0))
    return best


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from sparse_rl_megatron.algo import prepare_correction
    from sparse_rl_megatron.learner import Learner, LearnerConfig, OptimConfig, SequenceBatch, TrainBatch
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
    from sparse_rl_megatron.trainer.engine_pool.pool import probe_weights, sync_weights
    from sparse_rl_megatron.trainer.engine_pool.weight_probe import probe_sequence
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

    model_dir = tempfile.mkdtemp(prefix="bench-sync-")
    save_tiny_hf_checkpoint(model_dir, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                            num_heads=8, num_kv_heads=2, intermediate_size=args.intermediate)
    learner = Learner(LearnerConfig(model_path=model_dir, optim=OptimConfig(lr=1e-5)))
    engine = HFRolloutEngine(model_dir, show_progress=False)
    params = sum(p.numel() for p in engine.model.parameters())
    gen = torch.Generator().manual_seed(0)
    rows = [(torch.randint(args.vocab, (args.prompt_len,), generator=gen),
             torch.randint(args.vocab, (args.response_len,), generator=gen)) for _ in range(args.rows)]
    seqs = SequenceBatch([p for p, _ in rows], [r for _, r in rows])
    old = learner.logprobs(seqs)
    prepared = prepare_correction(old, old.clone(), seqs.response_mask(), torch.rand(args.rows),
                                  torch.arange(args.rows) // 4)
    probe = probe_sequence(args.vocab, args.probe_tokens, seed=0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.response_len, ignore_eos=True, seed=0)
    prompts = [p.tolist() for p, _ in rows[: args.rows // 4]]

    results = [("train step (reference)", timed(lambda: learner.train_step(TrainBatch(seqs, prepared)), args.iters)),
               (f"rollout {len(prompts)} x 4 x {args.response_len} tok", timed(
                   lambda: engine.generate(prompts, 4, sampling), 1))]
    for mb in args.buckets_mb:
        results.append((f"sync, {mb} MiB buckets", timed(lambda: sync_weights(learner, engine, 1, mb), args.iters)))
    results.append((f"probe ({args.probe_tokens} tokens)", timed(
        lambda: probe_weights(learner, engine, probe, 1e-3, "hf", 1), args.iters)))
    ref = results[0][1][0]
    print(f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, one thread; model "
          f"{params / 1e6:.2f}M params ({4 * params / 2**20:.1f} MiB fp32); train step and rollout: {args.rows} rows "
          f"x ({args.prompt_len} + {args.response_len}) tokens\n")
    print("| operation | CPU s | x train step | wall s |\n| --- | ---: | ---: | ---: |")
    for name, (cpu, wall) in results:
        print(f"| {name} | {cpu:.4f} | {cpu / ref:.3f} | {wall:.4f} |")


if __name__ == "__main__":
    main()
