"""Activation memory of one micro-batch: what each layer keeps for backward, by kernel set.

Two kernel sets, chosen by name (``KERNELS``):

- ``local``: megatron-core's own modules (``get_gpt_layer_local_spec``; the CPU learner). Every term below was
  measured on the CPU learner by recording the tensors autograd saves (``tests/megatron``: the learner check
  ``plan_matches_learner``): per token and layer the RMSNorm input, normalised input and output for both norms
  (6h + 2 rstd), q and the GQA-expanded k, v (3 a d / t), the attention output (a d / t), the gate/up output,
  SiLU output, product and fc2 input (5 F / t); per position RoPE's cos/sin for q and k (4d, shared by the
  rows); per row the softmax probabilities [a / t, s, s]; Qwen3's q/k norms add (2a + 3g) d / t + (a + g) / t
  per token (the fused QKV output that q and k are views of, the normalised q and k, their rstd), and a d / t
  more when a rank holds several KV groups (g / t > 1: reshaping q copies it).
- ``fused``: Transformer Engine (GPU): LayerNormLinear keeps input and normalised input (2h per norm),
  flash attention keeps q, k, v, its output and the softmax statistics (no [s, s] tensor), the fused SwiGLU keeps
  its input (2F / t) and fc2 its input (F / t). An estimate from what those kernels save; not measured here.

A mixture of experts replaces the MLP's terms (``moe_per_token``). Tokens are assumed routed evenly, so each
expert-parallel rank's experts work on ``top_k`` x its own tokens (an unbalanced router moves that work between
ranks: plan headroom, or read ``train/moe_load_balancing_loss``, ~1 when balanced). ``local`` (measured on the CPU
learner, megatron-core's alltoall dispatcher and SequentialMLP): per token the router's logits and routing map
(E (e + 1) bytes), per routed token-expert pair the permuted input (h), the fc1 output, SiLU output, product and
the product scaled by the routing weight (6 F_e / t_e) and 24 bytes of routing weights and indices; a shared
expert as a dense MLP (5 F_s / t) plus its gate and its output (h + 3). ``fused`` (TE grouped GEMM, estimated):
per pair the permuted input, SwiGLU input and fc2 input (h + 3 F_e / t_e) and the same 24 bytes; a shared expert
as a fused MLP (3 F_s / t + h + 3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.utils.registry import Registry

# Per scored token: the gather index and the cross-entropy's target, mask and index tensors (33 B), and the
# corrected GRPO loss's response-aligned terms (a mask and nine fp32 [rows, T] tensors with the KL term, 37 B).
# Measured on CPU; a rounding error next to the layers at real sizes.
LOSS_BYTES_PER_SCORED_TOKEN = 33 + 37
INPUT_ID_BYTES = 8  # int64 token ids kept by the embedding
ROPE_EMBEDDING_BYTES = 4  # the fp32 rotary embedding [s, d]: kept once by full recompute's checkpoints


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one transformer layer keeps for backward on one TP rank, and its largest temporaries."""

    per_token: float
    """Kept bytes per token of the micro-batch."""
    per_position: float
    """Kept bytes per position of the (padded) row, shared by the micro-batch's rows (RoPE's cos / sin)."""
    per_row_square: float
    """Kept bytes per row and per (row length)^2 (unfused attention probabilities)."""
    temporary_per_row_square: float
    """Temporaries of one layer's attention beyond what it keeps, per row and (row length)^2."""
    mask_per_square: float
    """Bytes of the causal mask per (row length)^2, once per micro-batch (shared by the layers)."""
    final_norm_per_token: float
    """Kept bytes per token of the final norm (last stage)."""


KERNELS: Registry[Callable[[ModelArch, int, int, int], LayerActivations]] = Registry("kernel set")
ROUTING_BYTES_PER_PAIR = 24
"""Per routed token-expert pair: its routing weight (fp32) and the int64 indices of the permutation (measured)."""


def moe_per_token(arch: ModelArch, tp: int, etp: int, e: int, expert_terms: float, shared_terms: float) -> float:
    """Bytes one MoE layer's MLP keeps per token: the router's logits and map, ``top_k`` pairs of
    ``e (h + expert_terms F_e / etp) + ROUTING_BYTES_PER_PAIR``, and a shared expert's ``e (shared_terms F_s / tp + h
    + 3)``."""
    moe, h = arch.moe, arch.hidden_size
    out = moe.num_experts * (e + 1)
    out += moe.top_k * (e * (h + expert_terms * moe.ffn_hidden_size / etp) + ROUTING_BYTES_PER_PAIR)
    if moe.has_shared_expert:
        out += e * (shared_terms * moe.shared_expert_ffn_hidden_size / tp + h + 3)
    return out


@KERNELS.register("local")
def _local(arch: ModelArch, tp: int, e: int, etp: int | None = None) -> LayerActivations:
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    a, g = arch.num_attention_heads / tp, arch.num_query_groups / tp
    per_token = 6 * h + 2 + 4 * a * d + (5 * f / tp if arch.moe is None else 0)
    if arch.qk_norm:  # the fused QKV output (q and k are views of it), q and k normalised, their rstd
        per_token += (a + 2 * g) * d + (a + g) * d + a + g
        if g > 1:  # several KV groups per rank: reshaping q to [heads, d] copies it, and the norm keeps the copy
            per_token += a * d
    # temporaries of one attention: megatron-core's persistent baddbmm input buffer (allocated on GPU; on CPU its
    # pages are never touched), the scores, and the probabilities being built (or in backward two gradients)
    mlp = 0.0 if arch.moe is None else moe_per_token(arch, tp, tp if etp is None else etp, e, 6, 5)
    return LayerActivations(per_token=e * per_token + mlp, per_position=e * 4 * d, per_row_square=e * a,
                            temporary_per_row_square=3 * e * a, mask_per_square=1,
                            final_norm_per_token=e * (2 * h + 1))


@KERNELS.register("fused")
def _fused(arch: ModelArch, tp: int, e: int, etp: int | None = None) -> LayerActivations:
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    a, g = arch.num_attention_heads / tp, arch.num_query_groups / tp
    mlp = e * 3 * f / tp if arch.moe is None else moe_per_token(arch, tp, tp if etp is None else etp, e, 3, 3)
    per_token = e * (4 * h + (2 * a + 2 * g) * d) + mlp + 4 * (2 + a)  # + fp32 rstd x 2, softmax stats
    if arch.qk_norm:
        per_token += e * (a + g) * d
    return LayerActivations(per_token=per_token, per_position=0.0, per_row_square=0.0, temporary_per_row_square=0.0,
                            mask_per_square=0.0, final_norm_per_token=e * h + 4)


@dataclass(frozen=True)
class MicroBatchShape:
    """The planner's shape of one micro-batch (the learner's own is ``learner.batch.MicroBatch``): ``rows`` rows padded to ``row_len`` tokens, ``scored`` response
    tokens scored by the LM head; ``count`` such micro-batches per DP rank and step."""

    rows: int
    row_len: int
    scored: int
    count: int = 1

    @property
    def tokens(self) -> int:
        return self.rows * self.row_len


def micro_batches(rows_per_rank: int, row_len: int, scored_per_row: int, budget: int) -> MicroBatchShape:
    """As many whole rows as fit the token budget (at least one row: a longer row is its own micro-batch)."""
    per_mb = min(max(1, budget // row_len), rows_per_rank)
    return MicroBatchShape(rows=per_mb, row_len=row_len, scored=per_mb * scored_per_row, count=-(-rows_per_rank // per_mb))


def layer_bytes(layer: LayerActivations, mb: MicroBatchShape) -> float:
    """Bytes one layer keeps for one micro-batch."""
    return (layer.per_token * mb.tokens + layer.per_position * mb.row_len
            + layer.per_row_square * mb.rows * mb.row_len ** 2)
