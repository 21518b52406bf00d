"""What the megatron tests run on: tiny models, a fixed batch, the training settings and the tolerances.

Imported by the pytest side (which computes HF references with transformers) and by the workers (which
import only megatron-core and the project), so both sides agree on every number.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the suite's error model, for the workers
import numerics  # noqa: E402

# Llama 3.x RoPE scaling (HF rope_type "llama3"), shrunk so that it matters at the test's <= 24 positions:
# with head_dim 8 and rope_theta 100 the wavelengths are 6.3, 19.9, 62.8 and 199 tokens; the thresholds
# original_max_position_embeddings / high_freq_factor = 8 and / low_freq_factor = 32 put one frequency in each
# regime (kept, interpolated, divided by `factor` twice). Llama 3.1 itself: factor 8, 1, 4, 8192, theta 5e5.
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)

# Tiny HF models. Both Qwen2 variants have Qwen2.5-7B's 7:1 GQA ratio; the untied one has its 28 query /
# 4 KV heads. "llama" is a Llama 3.x (llama3 RoPE scaling). "qwen3" has q/k norms and head_dim 16 != hidden /
# heads = 8 (as in Qwen3-32B: 64 heads x 128 > hidden 5120). vocab 250 is padded to 256 in Megatron, so padded
# columns exist on the last TP rank. Norm weights (HF initialises them to 1) are randomised by the references
# so that a swapped or missing norm shows in the logits.
MODELS = {
    "qwen2_tied": dict(family="qwen2", vocab_size=250, hidden_size=112, num_heads=14, num_kv_heads=2,
                       intermediate_size=128, tie_word_embeddings=True),
    "qwen2_untied": dict(family="qwen2", vocab_size=250, hidden_size=112, num_heads=28, num_kv_heads=4,
                         intermediate_size=128, tie_word_embeddings=False),
    "llama": dict(family="llama", vocab_size=250, hidden_size=64, num_heads=8, num_kv_heads=2,
                  intermediate_size=128, tie_word_embeddings=False, rope_theta=100.0, rope_scaling=LLAMA3_ROPE),
    "qwen3": dict(family="qwen3", vocab_size=250, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, tie_word_embeddings=True),
}
# Tiny mixtures of experts (test_moe_*.py): 4 routed experts of width 32, top-2. "qwen3_moe" has Qwen3 attention
# (q/k norms, head_dim 16), renormalised top-k weights and an untied head (as Qwen3-30B-A3B); "qwen2_moe" has Qwen2
# attention (QKV bias), top-k weights as the softmax gives them, a sigmoid-gated shared expert of width 48 and tied
# embeddings. TP 2 divides the heads, KV groups and the shared expert; EP 2 and 4 divide the experts.
MOE_MODELS = {
    "qwen3_moe": dict(family="qwen3_moe", vocab_size=250, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, tie_word_embeddings=False, num_experts=4, experts_per_token=2,
                      moe_intermediate_size=32),
    "qwen2_moe": dict(family="qwen2_moe", vocab_size=250, hidden_size=64, num_heads=8, num_kv_heads=2,
                      intermediate_size=128, tie_word_embeddings=True, num_experts=4, experts_per_token=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48),
}
MOE_AUX_COEFF = 0.05  # the load-balancing loss's weight in the MoE step check: its gradient is a visible share
SEED = 0
NUM_LAYERS = 2  # build_tiny_model's default depth
NORM_STD = 0.2  # norm weights: 1 + NORM_STD * N(0, 1)
INIT_STD = 0.2  # peaked next-token distributions (logits of order 10): parity is checked where it is hard

PARITY_SEQ = 24  # tokens per row of ``parity_ids()`` and at most in ``sequences()``: the attention's reduction


def model_kwargs(name: str) -> dict:
    """The ``build_tiny_model`` keyword arguments (with ``family``) of a dense or MoE test model."""
    return dict(MODELS.get(name) or MOE_MODELS[name])


def forward_reductions(name: str) -> list[int]:
    """``numerics.transformer_reductions`` of model ``name``: what two implementations of the same forward, HF's
    and the learner's at any TP x PP (x EP), may sum in other orders (at most ``PARITY_SEQ`` keys)."""
    m = model_kwargs(name)
    hd = m.get("head_dim", m["hidden_size"] // m["num_heads"])
    if name in MOE_MODELS:
        return numerics.moe_transformer_reductions(m["hidden_size"], hd, m["num_heads"], NUM_LAYERS, PARITY_SEQ,
                                                   m["num_experts"], m["experts_per_token"],
                                                   m["moe_intermediate_size"],
                                                   m.get("shared_expert_intermediate_size", 0))
    return numerics.transformer_reductions(m["hidden_size"], hd, m["num_heads"], m["intermediate_size"],
                                           NUM_LAYERS, PARITY_SEQ)


def logits_atol(name: str, max_abs_logit: float) -> float:
    """Learner vs HF logits: the chain bound of ``numerics`` over ``forward_reductions`` at the logits' scale.
    (For qwen2_tied, |logit| ~ 10: ~8e-3; a wrong weight, sign or position moves logits by O(1).)"""
    return numerics.chain_bound(forward_reductions(name), max_abs_logit)


def logprob_atol(name: str, max_abs_logit: float) -> float:
    """Learner vs ``log_softmax(HF logits)``: ``numerics.forward_logprob_bound``."""
    return numerics.forward_logprob_bound(forward_reductions(name), model_kwargs(name)["vocab_size"], max_abs_logit)



def step_rtol(name: str) -> float:
    """Relative error of a training step's loss and gradient norm, learner vs HF: the forward chain, the backward
    chain through the same reductions (the transposed matmuls sum over the other dimension of each weight,
    the same set of lengths here) and the weight gradients' sum over the batch's tokens, at scale 1 (relative).
    (~2e-3: a doubled gradient or a loss counted twice is off by 100%.)"""
    return numerics.chain_bound(2 * forward_reductions(name) + [PARITY_SEQ * 6], 1.0)


def chunk_atol(hf: dict[str, torch.Tensor], name: str) -> float:
    """Chunked vs unchunked LM head on the same hidden states (``numerics.logprob_head_bound``), from the
    checkpoint's weights: |h|_2 <= sqrt(H) max|g| after the final RMSNorm (x / rms(x) has norm sqrt(H)), the
    largest row norm of the head, |z| <= |h|_2 max_v |W_v|_2."""
    m = model_kwargs(name)
    head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    h_norm = m["hidden_size"] ** 0.5 * hf["model.norm.weight"].abs().max().item()
    row = head.norm(dim=1).max().item()
    return numerics.logprob_head_bound(m["hidden_size"], m["vocab_size"], h_norm, row, h_norm * row)


# One Adam step moves a weight by lr * g / (|g| + eps): about lr * sign(g). A layout changes the gradient
# only by float reassociation (absolute ~1e-9 here), so after one step the weights agree with the
# single-process HF reference within lr * 1e-9 / eps. With eps = 1e-8 a weight whose gradient is ~0 would
# move by a ratio of rounding errors (seen: 1.2e-4 on 0.01% of weights); eps = 1e-5 bounds that by ~1e-7,
# so STEP_ATOL = lr / 100 leaves a wide margin while a wrong gradient (sign or scale) moves weights by ~lr.
LR = 1e-3
STEP_ATOL = LR / 100
TRAIN = dict(lr=LR, betas=(0.9, 0.98), eps=1e-5, weight_decay=0.1, clip_grad=1.0)
KL_COEF = 0.05


ONE_ROW = 3  # the row of ``sequences()`` trained alone when a batch has fewer rows than DP ranks (a 7-token response)


def one_row_prepared(prepared):
    """Row ``ONE_ROW`` of a prepared batch as a batch of its own, ``[1, R]`` with R its response length (its
    normalisers are its own sums, as the learner's global all-reduce computes them for a one-row batch)."""
    import dataclasses

    from sparse_rl_megatron.algo.normalisers import local_normalisers

    n = len(sequences()[1][ONE_ROW])
    one = prepared.select([ONE_ROW])
    one = dataclasses.replace(one, **{k: getattr(one, k)[:, :n] for k in (
        "old_log_probs", "response_mask", "loss_mask", "weights", "log_rho")})
    return dataclasses.replace(one, normalisers=local_normalisers(one.loss_mask, one.response_mask, one.weights))


def parity_ids() -> torch.Tensor:
    """[2, 24] token ids for the logits comparison."""
    return torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(1))


def sequences() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Six rows of prompt / response ids with different lengths (padding and packing both matter)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (n,), generator=g) for n in (5, 3, 8, 4, 6, 2)]
    responses = [torch.randint(0, 250, (n,), generator=g) for n in (6, 9, 2, 7, 4, 5)]
    return prompts, responses


def rollout_tensors(old: torch.Tensor, mask: torch.Tensor):
    """Sampler log-probs, rewards, groups and reference log-probs for a training batch (fixed noise)."""
    g = torch.Generator().manual_seed(3)
    sampler = torch.where(mask, old + 0.3 * torch.randn(old.shape, generator=g), torch.zeros(()))
    ref = torch.where(mask, old + 0.2 * torch.randn(old.shape, generator=g), torch.zeros(()))
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    return sampler, rewards, groups, ref


def learner_config(path: str, tp: int = 1, pp: int = 1, **kw):
    from sparse_rl_megatron.algo import LossConfig
    from sparse_rl_megatron.learner.config import LearnerConfig, OptimConfig

    optim = OptimConfig(lr=TRAIN["lr"], adam_beta1=TRAIN["betas"][0], adam_beta2=TRAIN["betas"][1],
                        adam_eps=TRAIN["eps"], weight_decay=TRAIN["weight_decay"], clip_grad=TRAIN["clip_grad"],
                        use_distributed_optimizer=kw.pop("distributed_optimizer", False))
    kw.setdefault("max_tokens_per_device", 24)  # several micro-batches for the six rows
    kw.setdefault("logprob_chunk_tokens", 5)
    kw.setdefault("params_dtype", "float32")
    return LearnerConfig(model_path=path, tensor_parallel_size=tp, pipeline_parallel_size=pp, layer_spec="local",
                         optim=optim, loss=LossConfig(kl_coef=KL_COEF), **kw)
