"""What every rollout engine offers the trainer and the evaluator (reference HF engine, SGLang engine)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence, runtime_checkable

import torch

from sparse_rl_megatron.rollout.sample import Sample

if TYPE_CHECKING:
    from sparse_rl_megatron.compression import CompressionConfig


@dataclass
class SamplingParams:
    """How to sample responses."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    max_new_tokens: int = 256
    """Largest number of response tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation of a sample ends once its text contains one of them."""
    ignore_eos: bool = False
    """Keep generating after EOS (benchmarks)."""
    seed: int | None = None
    """Seed of the sampler; the same seed gives the same samples."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


def encode_prompt(prompt: str | Sequence[int], index: int, tokenizer=None, vocab_size: int | None = None) -> list[int]:
    """A prompt as token ids (strings need ``tokenizer``); refuses empty prompts and ids outside the vocab."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt {index} is a string but the engine has no tokenizer; pass token ids")
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError(f"prompt {index} is empty (at least one token is needed)")
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"prompt {index} has token ids outside [0, {vocab_size})")
    return ids


def check_prefixes(prefixes: Sequence[Sequence[int]] | None, prompts: int) -> list[list[int]] | None:
    """``generate``'s ``prefixes`` as lists of ints, one per prompt (None: no prompt is continued)."""
    if prefixes is None:
        return None
    out = [[int(t) for t in p] for p in prefixes]
    if len(out) != prompts:
        raise ValueError(f"generate: prefixes must hold one token list per prompt ({prompts}); got {len(out)}")
    return out


def check_group_ids(group_ids: Sequence[int] | None, prompts: int) -> list[int]:
    """The GRPO group id of each of ``prompts`` prompts: ``group_ids`` (one distinct int per prompt), else
    0, 1, ...; refuses a wrong count or repeated ids."""
    if group_ids is None:
        return list(range(prompts))
    ids = [int(g) for g in group_ids]
    if len(ids) != prompts or len(set(ids)) != len(ids):
        raise ValueError(f"generate: group_ids must be {prompts} distinct ids, one per prompt; got {ids}")
    return ids


ENGINE_MEMORY_PARTS: tuple[str, ...] = ("weights", "kv_cache")
"""What an engine's ``resume_memory`` can take back, one part at a time: the weights first (a weight sync needs only
them), the KV cache (with SGLang's captured graphs) once the learner has gone to sleep."""


def check_memory_parts(parts: Sequence[str], where: str) -> tuple[str, ...]:
    """``parts`` if each is one of ``ENGINE_MEMORY_PARTS``; ``ValueError`` naming the valid ones otherwise."""
    unknown = [p for p in parts if p not in ENGINE_MEMORY_PARTS]
    if unknown or not parts:
        raise ValueError(f"{where}: memory parts {list(parts)}; valid: {', '.join(ENGINE_MEMORY_PARTS)} (one or more)")
    return tuple(parts)


@runtime_checkable
class RolloutEngine(Protocol):
    """A generator of GRPO groups that can receive new weights: everything the trainer, the evaluator and the
    mismatch study call on an engine (``rollout/engine_registry.py`` builds them by name). Both built-in engines,
    ``HFRolloutEngine`` and ``SGLangRolloutEngine``, implement every member; a plugin engine must too."""

    weight_version: int
    """Version of the weights the engine serves (stamped on every sample; the weight-sync probe checks it)."""

    @property
    def tokenizer(self) -> Any:
        """The model's HF tokenizer, or None (then prompts must be token ids and stop strings are refused)."""
        ...

    def generate(
        self, prompts: Sequence[str | list[int]], n: int, sampling: SamplingParams, *,
        group_ids: Sequence[int] | None = None, compression: "CompressionConfig | None" = None,
        budgets: Sequence[int] | None = None, prefixes: Sequence[Sequence[int]] | None = None,
    ) -> list[Sample]:
        """Sample ``n`` responses per prompt; returns ``len(prompts) * n`` samples, group-major
        (all samples of prompt 0 first), with ``group_id`` = ``group_ids[p]`` (default: the prompt index p).
        A sample's randomness comes from ``(sampling.seed, group_id, index_in_group)``, so one shard of a batch
        sampled with its global group ids is the same shard of the batch sampled whole. ``compression`` replaces
        the engine's KV compression for this call (the adaptive budget); ``budgets[p]`` is prompt p's own budget.
        ``prefixes[p]``: response tokens already sampled for prompt p (a carried partial rollout, continued): they are
        prefilled after the prompt as response tokens (under ``scope: response`` they are budget candidates), stop
        strings are matched on prefix + new tokens, ``sampling.max_new_tokens`` bounds the new ones, and the samples
        hold only the new tokens (``prompt_ids`` the prompt alone)."""
        ...

    def dense_logprobs(self, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """``[len(response)]`` T=1 log-probs of each response after its prompt under full attention (the
        weight-sync probe's engine side)."""
        ...

    def with_compression(self, compression: "CompressionConfig") -> "RolloutEngine":
        """A view of this engine that samples with another KV compression and serves the same (live) weights."""
        ...

    def update_weights(self, named_tensors: Iterable, version: int) -> None:
        """Load HF-named full tensors and set the weight version. ``named_tensors``: (hf_name, tensor) pairs or
        buckets (lists of pairs, as ``Learner.export_weights`` yields them), possibly a lazy iterator consumed
        once. Any subset of the parameters, except for engines that reload a whole model (SGLang's ``disk``
        sync): there one call carries every weight."""
        ...

    def update_weights_from_payloads(self, payloads: Iterable[list], version: int) -> None:
        """Load buckets serialized once per TP rank (per bucket, one payload per TP rank) and set the version;
        called only for an engine whose ``EngineSpec.payload_sync`` says so of its build (SGLang in process with
        ``tensor`` sync); other engines refuse it."""
        ...

    def release_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        """Free ``parts`` (of ``ENGINE_MEMORY_PARTS``; one already released is left as it is) while the learner
        uses the device; generation and scoring need both parts, weight loading the weights. Released weights
        come back undefined (SGLang's memory saver keeps no copy): a weight push follows their resume."""
        ...

    def resume_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        """Undo ``release_memory`` for ``parts`` (a part not released is left as it is)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine's servers and child processes (a no-op for an engine that has none)."""
        ...


PROTOCOL_MEMBERS: tuple[str, ...] = ("weight_version", *sorted(
    name for name in vars(RolloutEngine) if not name.startswith("_") and name != "weight_version"))
"""Every member of ``RolloutEngine``: what an engine is checked for once, when it is built."""


def missing_members(engine: object) -> list[str]:
    """The members of ``RolloutEngine`` that ``engine`` lacks (``rollout/engine_registry.py`` refuses such an engine when
    it is built, naming them, rather than at its first call mid-run)."""
    return [name for name in PROTOCOL_MEMBERS if not hasattr(type(engine), name) and not hasattr(engine, name)]
