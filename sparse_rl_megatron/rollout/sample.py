"""The unit of data that flows from a rollout engine to the learner, with its provenance.

Every sample records which weights produced it, how the KV cache was compressed while it was sampled,
and the sampler's own per-token log-probs (``pi_sparse``), which Sparse-RL's correction needs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CompressionInfo:
    """How the KV cache was compressed while one sample was generated."""

    method: str = "none"
    """Scorer name (``none`` = dense, full KV cache)."""
    budget: int | None = None
    """Token budget B kept after each compression (None = dense)."""
    window: int = 0
    """Observation window alpha: the most recent tokens always kept, and the queries used for scoring."""
    buffer: int = 0
    """Buffer W: compression runs when the retained length reaches B + W."""
    scope: str = "all"
    """Which tokens count against the budget: ``all`` (prompt included) or ``response``."""
    events: int = 0
    """Number of compression events during this sample's generation."""
    peak_kv_tokens: int = 0
    """Largest number of KV tokens retained (per layer and KV head) at any point of the generation."""
    kept_digest: str | None = None
    """Optional hash of the kept indices of every event (to compare engines)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ROUTE_DTYPE = torch.int16
"""Recorded expert ids (``Sample.routed_experts``): 2 bytes per (token, layer, k); experts < 32768."""


@dataclass
class Sample:
    """One generated response to one prompt, with everything the learner and the logs need.

    Shapes: ``R`` = number of response tokens.
    """

    prompt_ids: list[int]
    """Token ids of the prompt (after the chat template)."""
    response_ids: list[int]
    """Token ids of the response, [R]; includes the EOS token when the sample stopped on EOS."""
    sampler_logprobs: torch.Tensor
    """[R] float32: log pi_sparse(y_t) at temperature 1 (the log-probs Sparse-RL's ratio uses)."""
    sampler_logprobs_scaled: torch.Tensor | None = None
    """[R] float32: log-probs under the temperature/top-p/top-k distribution actually sampled from."""
    response_text: str = ""
    prompt_text: str = ""
    finish_reason: str = "length"
    """``eos`` | ``stop`` (a stop string) | ``length`` (max new tokens)."""
    group_id: int = 0
    """Index of the prompt in the batch: the GRPO group."""
    index_in_group: int = 0
    weight_version: int = 0
    """Version of the weights that generated the sample (incremented at each weight sync)."""
    compression: CompressionInfo = field(default_factory=CompressionInfo)
    reward: float | None = None
    reward_reason: str | None = None
    """``correct`` | ``wrong`` | ``no_answer`` | ``timeout`` | ``parse_error``."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything the data source attaches (gold answer, dataset name, source id)."""
    routed_experts: torch.Tensor | None = None
    """Mixtures of experts, when the engine records routes (routing replay, ``learner.moe.routing_replay``):
    ``[P + R - 1, layers, top_k]`` int16, the experts every fed token went to in every layer as the sampler computed
    it (the prompt's P tokens at prefill, then the first R - 1 response tokens at decode, under the sampler's
    compressed cache); slime's ``rollout_routed_experts``. None otherwise."""

    token_versions: list[int] | None = None
    """[R] the weight version each response token was sampled under, when they differ (a partial rollout continued
    across weight syncs: ``trainer/partial_rollouts.py``); None: every token's is ``weight_version``."""

    def __post_init__(self) -> None:
        if self.token_versions is not None and len(self.token_versions) != len(self.response_ids):
            raise ValueError(f"Sample.token_versions has {len(self.token_versions)} entries but response_ids has "
                             f"{len(self.response_ids)}; one version per response token")
        if len(self.sampler_logprobs) != len(self.response_ids):
            raise ValueError(
                f"Sample.sampler_logprobs has {len(self.sampler_logprobs)} entries but response_ids has "
                f"{len(self.response_ids)}; they must match one log-prob per response token"
            )
        fed = len(self.prompt_ids) + max(len(self.response_ids) - 1, 0)
        if self.routed_experts is not None and (self.routed_experts.dim() != 3 or len(self.routed_experts) != fed):
            raise ValueError(f"Sample.routed_experts has shape {list(self.routed_experts.shape)}; need "
                             f"[{fed}, layers, top_k] (prompt + response - 1 fed tokens)")

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def versions(self) -> list[int]:
        """[R] the weight version of every response token."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.weight_version] * len(self.response_ids)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (tensors become lists)."""
        out = dataclasses.asdict(self)
        for key in ("sampler_logprobs", "sampler_logprobs_scaled"):
            value = getattr(self, key)
            out[key] = None if value is None else [float(x) for x in value]
        out["compression"] = self.compression.to_dict()
        out["routed_experts"] = None if self.routed_experts is None else self.routed_experts.tolist()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        data = dict(data)
        data["compression"] = CompressionInfo(**data.get("compression", {}))
        for key in ("sampler_logprobs", "sampler_logprobs_scaled"):
            if data.get(key) is not None:
                data[key] = torch.tensor(data[key], dtype=torch.float32)
        if data.get("routed_experts") is not None:
            data["routed_experts"] = torch.tensor(data["routed_experts"], dtype=ROUTE_DTYPE)
        return cls(**data)
