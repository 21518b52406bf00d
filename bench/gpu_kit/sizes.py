"""What each part of the GPU check measures, at the H200 sizes (``FULL``) and the toy CPU sizes (``TOY``).

The two presets run the same code; only these numbers differ. ``FULL`` is the issue's setting: a random
Qwen2.5-1.5B-shaped model (the bundled config ``qwen2.5-1.5b``: 28 layers, hidden 1536, 12 / 2 heads, FFN
8960, vocab 151936, tied embeddings), 4096-token rows, and the engine at B = 512, W = 128 with 4096-token
responses. ``TOY`` is a 2-layer, 64-wide Qwen2 with a 16384-token vocabulary
(its 1024 x 16384 fp32 logits still dominate the toy's memory, as Qwen2.5's do at 4096 tokens), and scales the
engine's B : W : response, 512 : 128 : 4096, by 1/32.

Time boxes are seconds of wall time per part; their sum is the whole run's budget (``deadline_s``). A part
that ends early leaves its unused seconds to the parts after it (``driver.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

H200_BF16_DENSE_PEAK_FLOPS = 989e12
"""Dense bf16 tensor-core peak of one H200 (SXM), the MFU denominator."""

PARTS = ("model", "logprobs", "lm_head_memory", "train", "train_recompute", "engine")
"""The parts, in the order they run (the carried-wheel set-up runs before them, inside the driver)."""


@dataclass(frozen=True)
class Sizes:
    """The sizes of one preset; every field is used by exactly one part (named in its prefix)."""

    label: str
    model: str | dict
    """A bundled config name (``models/configs``) or ``tiny_config`` keyword arguments."""
    # logprobs: learner vs HF, fp32 and bf16
    lp_rows: int
    lp_prompt: int
    lp_response: int
    # lm_head_memory: one row, chunked vs unchunked LM head
    mem_response: int
    mem_chunk: int
    # train / train_recompute: tokens/s, MFU, checkpoint save + load
    train_rows: int
    train_prompt: int
    train_response: int
    """Response tokens per row; a row feeds ``train_prompt + train_response - 1`` tokens."""
    train_iters: int
    """Timed train steps after one warm-up step (the fastest is kept)."""
    # engine: dense vs R-KV vs SnapKV decode
    eng_prompts: int
    eng_samples: int
    eng_prompt_len: int
    eng_response: int
    eng_budget: int
    eng_buffer: int
    eng_window: int
    eng_memory_budget_bytes: int
    """The fixed memory budget the "sequences that fit" column divides by each method's bytes per sequence."""
    boxes: dict = field(default_factory=dict)
    """Part name -> time box in seconds (``setup`` included)."""

    @property
    def train_row_tokens(self) -> int:
        return self.train_prompt + self.train_response - 1

    @property
    def eng_rows(self) -> int:
        return self.eng_prompts * self.eng_samples

    @property
    def deadline_s(self) -> float:
        return float(sum(self.boxes.values()))


FULL = Sizes(
    label="H200", model="qwen2.5-1.5b",
    lp_rows=2, lp_prompt=64, lp_response=960,
    mem_response=4096, mem_chunk=512,
    train_rows=8, train_prompt=512, train_response=3585, train_iters=2,
    eng_prompts=4, eng_samples=8, eng_prompt_len=128, eng_response=4096, eng_budget=512, eng_buffer=128,
    eng_window=8, eng_memory_budget_bytes=64 * 2**30,
    # 465 s in all (the 8 minutes less a margin for the driver's own start and the report), set from
    # `gpu_check.py --estimate` (bench/README.md): the learner parts ~25% above their estimates, the engine last,
    # so what they leave unused goes to it (its estimate, ~220 s, exceeds its own box)
    boxes=dict(setup=10, model=35, logprobs=55, lm_head_memory=45, train=85, train_recompute=45, engine=190),
)

TOY = Sizes(
    label="toy (CPU)",
    model=dict(vocab_size=16384, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    lp_rows=2, lp_prompt=16, lp_response=48,
    mem_response=1024, mem_chunk=128,
    train_rows=4, train_prompt=32, train_response=97, train_iters=1,
    eng_prompts=2, eng_samples=2, eng_prompt_len=16, eng_response=128, eng_budget=16, eng_buffer=4,
    eng_window=4, eng_memory_budget_bytes=64 * 2**20,
    # a loaded 2-core CI machine: each part's process start (torch + megatron-core imports) is most of it
    boxes=dict(setup=30, model=60, logprobs=90, lm_head_memory=90, train=120, train_recompute=90, engine=120),
)


def preset(cpu: bool) -> Sizes:
    return TOY if cpu else FULL
