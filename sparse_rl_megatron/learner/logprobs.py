"""Per-token log-probs from the last stage's hidden states: vocab-parallel and chunked along the tokens.

Only the positions whose next token we score are gathered (``MicroBatch.gather_index``: the response tokens),
and the LM head runs on ``chunk_tokens`` of them at a time, so at most ``[chunk, vocab / TP]`` logits exist at
once instead of ``[b * S, vocab]`` (4096 tokens x 152k vocab is 2.5 GB in fp32 per copy). With gradients
enabled each chunk is recomputed in backward (``torch.utils.checkpoint``), so training does not keep the
chunks' logits alive either.

log p(y) = -vocab_parallel_cross_entropy(logits, y) (megatron-core ``tensor_parallel``), computed in fp32;
the padded vocabulary columns are set to -inf first, so they carry no probability mass.

Sequence parallel: the decoder output is split along the sequence, ``[S / tp, b, H]`` per TP rank. It is
gathered whole first (backward: reduce-scatter of the gradients), then indexed like the unsplit case; and since
the LM head all-gathers its input along the sequence under sequence parallel, each TP rank hands it its own
1/tp of a chunk's tokens, so the head sees every scored token exactly once.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from sparse_rl_megatron.learner.batch import MicroBatch
from sparse_rl_megatron.learner.model_provider import unwrap

# Default number of scored tokens per LM-head chunk: [512, 152k / TP] fp32 logits is ~310 MB at TP = 1,
# small next to a 7B model's activations, and large enough that the head matmul stays efficient.
DEFAULT_CHUNK_TOKENS = 512


def _chunk_logprobs(model, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``hidden [c, H]``, ``labels [c]`` -> ``[c]`` fp32 log-probs (collective over the TP group)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    c = hidden.shape[0]
    if model.output_layer.sequence_parallel:  # the head gathers its input: give it this rank's share
        tp = ps.get_tensor_model_parallel_world_size()
        hidden = torch.cat([hidden, hidden.new_zeros(-c % tp, hidden.shape[1])])
        hidden = hidden.chunk(tp)[ps.get_tensor_model_parallel_rank()]
    logits, _ = model.output_layer(hidden.unsqueeze(1), weight=model.output_weight())  # [c (+pad), 1, V/tp]
    logits = logits[:c].float()
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local > model.true_vocab_size:  # this rank holds padded columns
        col = torch.arange(start, start + local, device=logits.device)
        logits = logits.masked_fill(col >= model.true_vocab_size, float("-inf"))
    return -vocab_parallel_cross_entropy(logits, labels.unsqueeze(1)).squeeze(1)


def token_logprobs(model, hidden: torch.Tensor, mb: MicroBatch, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Log-probs ``[n]`` (fp32) of ``mb.labels`` from the decoder output ``hidden [S, b, H]``
    (``[S / tp, b, H]`` under sequence parallel).

    ``chunk_tokens <= 0`` runs the head on all n tokens at once (the unchunked reference).
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    inner = unwrap(model)
    if inner.config.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)  # [S, b, H]
    flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
    index = mb.gather_index.to(flat.device)
    labels = mb.labels.to(flat.device)
    picked = flat.index_select(0, index)  # [n, H]
    n = picked.shape[0]
    step = n if chunk_tokens <= 0 else chunk_tokens
    if n == 0:
        return picked.new_zeros(0, dtype=torch.float32)
    out = []
    for s in range(0, n, step):
        h, y = picked[s:s + step], labels[s:s + step]
        if torch.is_grad_enabled() and step < n:
            out.append(checkpoint(_chunk_logprobs, inner, h, y, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(inner, h, y))
    return torch.cat(out)


def to_response_aligned(values: torch.Tensor, mb: MicroBatch, width: int) -> torch.Tensor:
    """Scatter ``[n]`` per-token values into ``[len(mb.rows), width]`` (0 where there is no token)."""
    out = values.new_zeros(len(mb.rows), width)
    out[mb.out_row.to(values.device), mb.out_col.to(values.device)] = values
    return out
