"""The expected H200 seconds of each part, from its FLOP count and the engine's counted ops, next to its box.

Not a measurement: a check that the boxes fit the work before a device is lent. Learner parts: model FLOPs
of every forward and train step the part runs (``learner/flops.py``, a train step 3x its forward, full
recompute one more forward) at an assumed achieved rate, plus fixed costs (process start, learner build, the
first torch.compile of megatron's fusions, checkpoint bytes through the disk). Engine: the host issues every
aten op of a decode step one by one (the engine syncs on each step's sampled tokens, so host and GPU do not
overlap); the ops per step are COUNTED here by running the real engine on a model with the 1.5B shape's layer
count and heads at a tiny width on the CPU (the count does not depend on the width), and the bytes per step
(weights, the cache read, and the math SDPA backend's copy of K/V expanded to the query heads) go at an
assumed bandwidth. Every assumption is a named constant in ``ASSUMED``.
"""
from __future__ import annotations

import time

from gpu_kit.sizes import FULL, Sizes

ASSUMED = dict(
    start_s=8.0,            # python + torch + transformers + megatron-core imports, CUDA context
    build_s=8.0,            # learner build + 3 GB of safetensors from the page cache + optimizer set-up
    compile_s=20.0,         # megatron's torch.compile'd SwiGLU / bias-dropout-add, first call per process
    learner_flops=300e12,   # achieved bf16 FLOP/s of the local spec (unfused attention): ~30% of 989 T
    disk_bytes_s=1.5e9,     # checkpoint write and read
    op_s=5e-6,              # host seconds per aten op of the decode loop (dispatch + launch; views less)
    hbm_bytes_s=3.0e12,     # achieved HBM bandwidth (of 4.8 TB/s)
    pcie_bytes_s=20e9,      # device <-> pinned host copies (PCIe 5 x16 achieves ~50 GB/s; half of it assumed)
    pin_bytes_s=10e9,       # cudaHostAlloc of the offload's host copies (first sleep only)
)


def _arch(sizes: Sizes):
    from sparse_rl_megatron.models.arch import arch_from_hf_config
    from sparse_rl_megatron.models.catalog import bundled_config

    return arch_from_hf_config(bundled_config(sizes.model))


def count_decode_ops(sizes: Sizes, steps: int = 24) -> dict[str, float]:
    """Aten ops per decode step of the real engine, per method (compressions amortised over the steps), on a
    model with ``sizes``' layers and heads at head_dim 8 and a small vocabulary (CPU, seconds)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
    from sparse_rl_megatron.models.tiny import build_tiny_model

    arch = _arch(sizes)
    model = build_tiny_model("qwen2", vocab_size=512, hidden_size=8 * arch.num_attention_heads,
                             num_layers=arch.num_layers, num_heads=arch.num_attention_heads,
                             num_kv_heads=arch.num_query_groups, intermediate_size=64)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    out = {}
    for method in ("none", "rkv", "snapkv"):
        # B : W scaled so that `steps` decode steps hold several compressions, as 4096 steps hold ~28
        compression = CompressionConfig(method=method, budget=16, buffer=4, window=4)
        engine = HFRolloutEngine(model, compression=compression, max_batch_size=2, show_progress=False)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=steps, ignore_eos=True, seed=0)
        Count.ops = 0
        with Count():
            engine.generate([list(range(3, 19))], 2, sampling)
        out[method] = Count.ops / steps
    return out


def _learner_parts(sizes: Sizes, a: dict) -> dict[str, tuple[float, str]]:
    from sparse_rl_megatron.learner.flops import forward_flops, train_step_flops

    arch = _arch(sizes)
    lp_rows = [sizes.lp_prompt + sizes.lp_response - 1] * sizes.lp_rows
    mem = [16 + sizes.mem_response - 1]
    rows = [sizes.train_row_tokens] * sizes.train_rows
    fwd = forward_flops(arch, rows, sizes.train_rows * sizes.train_response)
    step = train_step_flops(arch, rows, sizes.train_rows * sizes.train_response)
    mem_f = forward_flops(arch, mem, sizes.mem_response)
    params = _params(arch)
    ckpt_bytes = params * (2 + 4 + 8)  # bf16 weights, fp32 main params, Adam's two moments
    fixed = a["start_s"] + a["compile_s"]
    out = {
        "model": (a["start_s"] + 10 + 2 * params / a["disk_bytes_s"], "start + compile probe + 3 GB written"),
        "logprobs": (fixed + 2 * a["build_s"] + 4 * forward_flops(arch, lp_rows, sizes.lp_rows * sizes.lp_response)
                     / a["learner_flops"], "2 learners + HF fp32 / bf16 forwards"),
        "lm_head_memory": (fixed + a["build_s"] + (4 * mem_f + 3 * 3 * mem_f) / a["learner_flops"],
                           "1 learner, 3 forwards + 3 train steps of 4112 tokens"),
        "train": (fixed + a["build_s"] + (2 * fwd + (2 + sizes.train_iters) * step) / a["learner_flops"]
                  + 2 * ckpt_bytes / a["disk_bytes_s"] + ckpt_bytes / a["pin_bytes_s"]
                  + 2 * ckpt_bytes / a["pcie_bytes_s"],
                  f"{(2 + sizes.train_iters)} steps of {sum(rows)} tokens ({step / 1e12:.0f} TFLOP each) + "
                  f"checkpoint {ckpt_bytes / 2**30:.1f} GiB written and read + the offload's sleep and wake "
                  f"(weights + optimizer state to pinned host and back)"),
        "train_recompute": (fixed + a["build_s"] + (2 * fwd + (1 + sizes.train_iters) * step * 4 / 3)
                            / a["learner_flops"], "as train, recompute adds a forward; no checkpoint"),
    }
    return out


def _params(arch) -> int:
    from sparse_rl_megatron.planning.params import total_params

    return total_params(arch)


def _engine(sizes: Sizes, a: dict, ops: dict[str, float]) -> tuple[float, str]:
    from sparse_rl_megatron.planning.kv import kv_bytes_per_token

    arch = _arch(sizes)
    weights = 2 * _params(arch)
    per_token = kv_bytes_per_token(arch)
    expand = 1 + 2 * arch.num_attention_heads / arch.num_query_groups  # read, write + read the GQA copy
    total, notes = a["start_s"] + 5, []
    for method, n_ops in ops.items():
        held = (sizes.eng_budget + sizes.eng_buffer / 2 if method != "none"
                else sizes.eng_prompt_len + sizes.eng_response / 2)  # mean tokens attended per step
        step_bytes = weights + sizes.eng_rows * held * per_token * expand
        step_s = n_ops * a["op_s"] + step_bytes / a["hbm_bytes_s"]
        total += sizes.eng_response * step_s
        notes.append(f"{method} {n_ops:.0f} ops + {step_bytes / 1e9:.1f} GB per step = {1000 * step_s:.1f} ms")
    return total, "; ".join(notes)


def table(sizes: Sizes = FULL) -> str:
    start = time.perf_counter()
    ops = count_decode_ops(sizes)
    parts = _learner_parts(sizes, ASSUMED)
    parts["engine"] = _engine(sizes, ASSUMED, ops)
    lines = [f"H200 estimate for the {sizes.label} preset (ops counted in {time.perf_counter() - start:.0f} s on "
             f"this CPU; assumptions: {ASSUMED})", "", "| part | box s | estimate s | basis |",
             "| --- | ---: | ---: | --- |", f"| setup | {sizes.boxes['setup']} | 5 | pip --target of 3 wheels |"]
    for name, (seconds, basis) in parts.items():
        lines.append(f"| {name} | {sizes.boxes[name]} | {seconds:.0f} | {basis} |")
    total = 5 + sum(s for s, _ in parts.values())
    lines.append(f"| all | {sizes.deadline_s:.0f} | {total:.0f} | |")
    return "\n".join(lines)
