"""Do the samples of a step depend on how its groups are shared out over engines? HF vs SGLang, measured.

One engine of each kind (a random tiny Qwen2, R-KV cache, float32, CPU) samples a batch of GRPO groups with a
fixed seed three ways: the whole batch at once, the whole batch again (run-to-run determinism), and the groups
split into two shards sampled separately under their global group ids (what two engines of a run do). Per way:
the fraction of samples whose tokens equal the whole batch's, the fraction of tokens up to the first
difference, and the largest |log-prob difference| over the tokens before it.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_engine_shards.py [--skip-sglang]

Not a test (the HF identity is one: tests/unit/test_rollout_engine_shards.py).
"""
from __future__ import annotations

import argparse
import tempfile

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--skip-sglang", action="store_true")
    return p.parse_args(argv)


def compare(whole, other) -> tuple[float, float, float]:
    """(samples identical, tokens before the first difference, max |log-prob diff| there) of ``other`` vs ``whole``."""
    same = agree = total = 0
    worst = 0.0
    for a, b in zip(whole, other):
        assert (a.group_id, a.index_in_group) == (b.group_id, b.index_in_group)
        same += a.response_ids == b.response_ids
        k = 0
        while k < min(len(a.response_ids), len(b.response_ids)) and a.response_ids[k] == b.response_ids[k]:
            k += 1
        agree, total = agree + k, total + max(len(a.response_ids), len(b.response_ids))
        if k:
            worst = max(worst, float((a.sampler_logprobs[:k] - b.sampler_logprobs[:k]).abs().max()))
    return same / len(whole), agree / total, worst


def measure(engine, prompts, n, sampling) -> dict[str, tuple[float, float, float]]:
    whole = engine.generate(prompts, n, sampling)
    again = engine.generate(prompts, n, sampling)
    shards = [list(range(0, len(prompts), 2)), list(range(1, len(prompts), 2))]
    split = [s for share in shards for s in engine.generate([prompts[g] for g in share], n, sampling,
                                                              group_ids=share)]
    split.sort(key=lambda s: (s.group_id, s.index_in_group))
    return {"again": compare(whole, again), "2 shards": compare(whole, split)}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
    from sparse_rl_megatron.models.tiny import save_tiny_hf_checkpoint

    model_dir = save_tiny_hf_checkpoint(tempfile.mkdtemp(prefix="bench-shards-") + "/m", "qwen2", seed=3,
                                        init_std=0.2)
    compression = CompressionConfig(method="rkv", budget=12, window=2, buffer=4, scope="all")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(torch.randint(8, 40, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(args.prompts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=7, ignore_eos=True)
    rows = {"hf": measure(HFRolloutEngine(model_dir, compression=compression, show_progress=False), prompts,
                          args.samples, sampling)}
    if not args.skip_sglang:
        from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
        from sparse_rl_megatron.rollout.sglang_engine import SGLangRolloutEngine

        with SGLangRolloutEngine(SGLangEngineConfig(model_path=str(model_dir), compression=compression,
                                                    dtype="float32", max_total_tokens=8192)) as engine:
            rows["sglang"] = measure(engine, prompts, args.samples, sampling)
    print(f"# {args.prompts} groups x {args.samples} samples x {args.max_new_tokens} tokens, T = 1, seed 7, "
          f"R-KV B=12 W=4, float32, CPU")
    print("\n| engine | vs the whole batch | samples identical | tokens before the first difference | "
          "max abs log-prob diff there |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, result in rows.items():
        for way, (same, agree, worst) in result.items():
            print(f"| {name} | {way} | {same:.3f} | {agree:.3f} | {worst:.2g} |")


if __name__ == "__main__":
    main()
