"""A response sampled in pieces: a carried partial rollout and the tokens one more engine call added to it.

``generate(..., prefixes=[response so far])`` returns only the new tokens; ``extend`` joins them to the sample they
continue, keeping each token's provenance (its sampler log-prob and the weight version it was sampled under).
"""
from __future__ import annotations

import dataclasses

import torch

from sparse_rl_megatron.rollout.sample import CompressionInfo, Sample

FINISHED_REASONS: tuple[str, ...] = ("eos", "stop")
"""Finish reasons that end a response before its token limit (``length`` ends it only at the limit)."""


def is_finished(sample: Sample, max_new_tokens: int) -> bool:
    """Whether ``sample`` is a whole response: it stopped (EOS, a stop string) or reached ``max_new_tokens``."""
    return sample.finish_reason in FINISHED_REASONS or sample.response_length >= max_new_tokens


def extend(prev: Sample, part: Sample, tokenizer=None) -> Sample:
    """``prev``'s response followed by ``part``'s tokens (``part`` continued ``prev``: sampled with ``prev``'s response
    as its prefix). Identity, prompt and metadata are ``prev``'s; the finish reason, weight version and compression
    settings ``part``'s; every token keeps its own log-probs and version; compression events add up, the peak is the
    larger (the kept-index digest is dropped: the re-prefill between the pieces is not a compression event)."""
    if list(part.prompt_ids) != list(prev.prompt_ids):
        raise ValueError(f"extend: the continuation of sample {prev.group_id}/{prev.index_in_group} has another prompt")
    ids = [*prev.response_ids, *part.response_ids]

    def cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        return None if a is None or b is None else torch.cat([a, b])

    info = dataclasses.replace(part.compression, events=prev.compression.events + part.compression.events,
                               peak_kv_tokens=max(prev.compression.peak_kv_tokens, part.compression.peak_kv_tokens),
                               kept_digest=None)
    metadata = dict(prev.metadata)
    metadata["segments"] = int(prev.metadata.get("segments", 1)) + 1
    for key in ("retractions", "redraws"):
        if key in part.metadata or key in prev.metadata:
            metadata[key] = int(prev.metadata.get(key, 0)) + int(part.metadata.get(key, 0))
    text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else \
        prev.response_text + part.response_text
    return dataclasses.replace(
        prev, response_ids=ids, sampler_logprobs=torch.cat([prev.sampler_logprobs, part.sampler_logprobs]),
        sampler_logprobs_scaled=cat(prev.sampler_logprobs_scaled, part.sampler_logprobs_scaled),
        response_text=text, finish_reason=part.finish_reason, weight_version=part.weight_version,
        token_versions=[*prev.versions(), *[part.weight_version] * part.response_length],
        compression=CompressionInfo(**info.to_dict()), metadata=metadata, reward=None, reward_reason=None,
        routed_experts=None)
