"""The reference rollout engine: HF transformers modules, our compressed KV cache, batched GRPO groups.

It runs anywhere torch runs (the CPU default) and is the oracle the SGLang plugin is tested against:
compression goes through ``sparse_rl_megatron.compression`` exactly as documented there. Per chunk of
rows (up to ``max_batch_size`` sequences) it prefills each distinct prompt once, copies the prompt's
cache to its ``n`` samples, then decodes all rows in lockstep; finished rows leave the batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterable, Sequence

import torch

from sparse_rl_megatron.compression import CompressionConfig, CompressionSchedule
from sparse_rl_megatron.rollout.engine_protocol import (
    ENGINE_MEMORY_PARTS, SamplingParams, check_group_ids, check_memory_parts, check_prefixes, encode_prompt,
)
from sparse_rl_megatron.rollout.hf_forward import HFDecoder
from sparse_rl_megatron.rollout.centers import load_centers
from sparse_rl_megatron.rollout.kv_cache import CompressedKVCache, align_keys
from sparse_rl_megatron.rollout.sample import ROUTE_DTYPE, CompressionInfo, Sample
from sparse_rl_megatron.rollout.sampling import draw_uniforms, sample_tokens
from sparse_rl_megatron.rollout.stopping import StopChecker
from sparse_rl_megatron.rollout.weights import copy_named_tensors, iter_pairs, read_hf_safetensors

_SEED_RANGE = 2**62  # seeds drawn when SamplingParams.seed is None
_COMPACT_FRACTION = 4
"""Finished rows are dropped from the batch once they are >= 1/4 of it: each drop copies the whole cache,
while a finished row left in place only costs its share of the next decode steps."""


class HFRolloutEngine:
    """A :class:`~sparse_rl_megatron.rollout.engine_protocol.RolloutEngine` on an HF causal LM (CPU or GPU).

    Args:
        model: an HF model directory or a ``PreTrainedModel`` (used in place; cast to ``dtype`` if needed).
        tokenizer: a tokenizer, a directory to load one from, or None (then loaded from ``model`` if it is a
            directory holding one; without a tokenizer prompts must be token ids and stop strings are refused).
        compression: KV compression while sampling (None or method ``none`` = dense).
        dtype: compute dtype of the weights and the KV cache.
        max_batch_size: most sequences decoded together.
        show_progress: a tqdm bar per chunk of rows.
        weight_version: version of the loaded weights, stamped on every sample.
        record_routing: mixtures of experts: ``generate`` records every sample's routes (``Sample.routed_experts``:
            the experts each prompt token went to at prefill and each fed response token at decode, under the
            sample's own compressed cache) for routing replay in the learner.
    """

    def __init__(self, model, tokenizer=None, *, compression: CompressionConfig | None = None,
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 64, show_progress: bool = True,
                 weight_version: int = 0, record_routing: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"HFRolloutEngine.max_batch_size must be >= 1; got {max_batch_size}")
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            path = str(model)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
            if tokenizer is None and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
                tokenizer = path
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        if next(model.parameters()).dtype != dtype:
            model = model.to(dtype)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.compression = compression if compression is not None else CompressionConfig()
        self.schedule = CompressionSchedule(self.compression)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.show_progress = show_progress
        self.weight_version = weight_version
        self.decoder = HFDecoder(self.model)
        self.record_routing = bool(record_routing) and self.decoder.moe
        self._released: set[str] = set()  # ENGINE_MEMORY_PARTS not resumed since release_memory
        self._newline_ids: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable, version: int) -> None:
        """Load HF-named tensors (any subset; pairs or buckets of pairs, possibly lazy) and set the weight version."""
        self._check_resumed("update_weights", ("weights",))
        copy_named_tensors(self.model, iter_pairs(named_tensors))
        self.weight_version = version

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Load a full HF state dict (every weight but tied aliases must be present)."""
        copy_named_tensors(self.model, state_dict.items(), strict=True)
        if version is not None:
            self.weight_version = version

    def load_hf_dir(self, path: str | os.PathLike, version: int | None = None) -> None:
        """Load the weights of an HF directory (safetensors) into the model."""
        self.load_weights(read_hf_safetensors(path), version=version)

    def update_weights_from_payloads(self, payloads: Iterable[list], version: int) -> None:
        raise RuntimeError("HFRolloutEngine takes weights as tensors (update_weights), not per-TP-rank payloads")

    def shutdown(self) -> None:
        """Nothing to stop: the engine is this process's model."""

    def release_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        """Nothing persists between ``generate`` calls (KV caches are per call) and the weights stay; refuse what
        the released parts would serve until they are resumed, as an engine that frees them must."""
        self._released |= set(check_memory_parts(parts, "HFRolloutEngine.release_memory"))

    def resume_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        self._released -= set(check_memory_parts(parts, "HFRolloutEngine.resume_memory"))

    # ------------------------------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[str | list[int]], n: int, sampling: SamplingParams, *,
                 group_ids: Sequence[int] | None = None, compression: CompressionConfig | None = None,
                 budgets: Sequence[int] | None = None, prefixes: Sequence[Sequence[int]] | None = None
                 ) -> list[Sample]:
        """``n`` samples per prompt, group-major (all samples of prompt 0 first). ``group_ids[p]`` is prompt p's
        GRPO group id (default: p), stamped on its samples and seeding them: a shard of a batch sampled with its
        global ids draws the same uniforms as the whole batch, so it gives the same samples up to float rounding (a row
batched with other rows may get other BLAS kernels; see ``kv_cache.KEY_ALIGN``).

        ``compression`` replaces the engine's KV compression for this call (no rebuild: the adaptive budget changes
        it between steps); ``budgets[p]`` is prompt p's own budget B (the rest of the compression as for the call).
        Rows of one budget are decoded together, each budget in its own chunks; every sample's
        ``compression.budget`` is the budget it was sampled with.

        ``prefixes[p]`` continues prompt p's response (a carried partial rollout): prompt + prefix are prefilled
        together, the prefix's tokens are response tokens for the budget's scope (``CompressedKVCache.set_response_start``),
        stop strings may span it, and the samples hold the new tokens only."""
        self._check_resumed("generate")
        if n < 1:
            raise ValueError(f"generate: n must be >= 1; got {n}")
        gids = check_group_ids(group_ids, len(prompts))
        configs = self._prompt_configs(compression if compression is not None else self.compression, budgets,
                                       len(prompts))
        prompt_ids = [self._encode(p, i) for i, p in enumerate(prompts)]
        continued = check_prefixes(prefixes, len(prompts))
        if continued is not None:
            prompt_ids = [ids + pre for ids, pre in zip(prompt_ids, continued)]
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(_SEED_RANGE, ()).item())
        stopper = StopChecker(eos_ids=self._eos_ids(), stop=sampling.stop, ignore_eos=sampling.ignore_eos,
                              max_new_tokens=sampling.max_new_tokens, tokenizer=self.tokenizer)
        samples: list[Sample] = []
        distinct = [c for p, c in enumerate(configs) if c not in configs[:p]]  # in prompt order
        for config in distinct:
            rows = [(p, i) for p in range(len(prompt_ids)) if configs[p] == config for i in range(n)]
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start:start + self.max_batch_size]
                picker = _Sampler(sampling, seed, [(gids[p], i) for p, i in chunk], stopper,
                                  None if continued is None else [continued[p] for p, _ in chunk])
                samples.extend(self._run_chunk(prompt_ids, prompts, chunk, sampling.max_new_tokens, picker, config,
                                               None if continued is None else [len(c) for c in continued]))
        samples.sort(key=lambda s: (s.group_id, s.index_in_group))
        for s in samples:
            s.group_id = gids[s.group_id]
        return samples

    def with_compression(self, compression: CompressionConfig) -> "HFRolloutEngine":
        """An engine on the same model (same live weights) sampling with another KV compression."""
        return HFRolloutEngine(self.model, self.tokenizer, compression=compression, dtype=self.dtype,
                               max_batch_size=self.max_batch_size, show_progress=self.show_progress,
                               weight_version=self.weight_version, record_routing=self.record_routing)

    @torch.no_grad()
    def dense_logprobs(self, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """``[len(response)]`` log-probs of each response's tokens after its prompt under full attention, one
        forward pass each (the weight-sync probe's engine side)."""
        rows = []
        for prompt, response in zip(prompts, responses):
            prompt, response = torch.as_tensor(prompt, dtype=torch.long), torch.as_tensor(response, dtype=torch.long)
            if response.numel() == 0:
                rows.append(torch.zeros(0))
                continue
            ids = torch.cat([prompt, response]).unsqueeze(0).to(self.device)
            logits = self.model(input_ids=ids).logits[0, prompt.numel() - 1:-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, response.to(logits.device).unsqueeze(-1)).squeeze(-1)
            rows.append(lp.cpu())
        return rows

    @staticmethod
    def _prompt_configs(base: CompressionConfig, budgets: Sequence[int] | None, prompts: int
                        ) -> list[CompressionConfig]:
        """The compression of each prompt: ``base``, with ``budgets[p]`` as prompt p's budget when given."""
        if budgets is None:
            return [base] * prompts
        if len(budgets) != prompts:
            raise ValueError(f"generate: budgets must hold one budget per prompt ({prompts}); got {len(budgets)}")
        if base.is_dense:
            raise ValueError("generate: budgets were given but the compression is dense (method 'none')")
        return [dataclasses.replace(base, budget=b) for b in budgets]  # validated: B > window, an int

    def teacher_forced(self, prompts: Sequence[str | list[int]], responses: Sequence[Sequence[int]], *,
                       compression: CompressionConfig | None = None,
                       routing: Sequence[torch.Tensor] | None = None) -> list[Sample]:
        """Score given responses exactly as ``generate`` would have produced them: the oracle for other engines.

        Each (prompt, response) pair is prefilled and its response fed token by token through the same decode
        pass and the same compression schedule as ``generate`` (same events, same kept sets per layer and KV
        head), so ``sampler_logprobs`` are the T=1 log-probs the compressed cache gives each response token, and
        ``compression`` (events, peak, kept digest) is what ``generate`` records had it sampled these tokens.
        Use it to measure any engine's mismatch: feed that engine's sampled tokens and compare log-probs/digests.

        Returns one :class:`Sample` per pair, in order (``group_id`` = pair index, ``finish_reason`` ``length``,
        ``sampler_logprobs_scaled`` None, ``metadata["teacher_forced"]`` True).

        ``compression`` replaces the engine's for this call. Mixtures of experts: ``metadata["routing"]`` is a
        ``[len(response) - 1, layers, top_k]`` long tensor, the experts response token j went to in every layer
        when it was fed (it decides the log-prob of token j + 1; token 0's comes from the prompt, never
        compressed); ``routing`` (one such tensor per pair) replays those experts instead of the router's choice,
        with the router's own weights at them: e.g. a compressed replay routed as the dense model routes.
        ``Sample.routed_experts`` holds the prompt's experts at prefill followed by ``metadata["routing"]``: the
        routes the learner replays to compute these log-probs (``learner.moe.routing_replay``).
        """
        self._check_resumed("teacher_forced")
        if len(prompts) != len(responses):
            raise ValueError(f"teacher_forced: {len(prompts)} prompts but {len(responses)} responses; "
                             "pass one per prompt")
        prompt_ids = [self._encode(p, i) for i, p in enumerate(prompts)]
        forced = [[int(t) for t in r] for r in responses]
        vocab = self.model.config.vocab_size
        for i, r in enumerate(forced):
            if not r:
                raise ValueError(f"teacher_forced: response {i} is empty (at least one token is needed)")
            if min(r) < 0 or max(r) >= vocab:
                raise ValueError(f"teacher_forced: response {i} has token ids outside [0, {vocab})")
        routes = self._check_routing(routing, forced)
        rows = [(g, 0) for g in range(len(prompt_ids))]
        samples: list[Sample] = []
        config = compression if compression is not None else self.compression
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start:start + self.max_batch_size]
            picker = _Forced([forced[g] for g, _ in chunk], None if routes is None else [routes[g] for g, _ in chunk],
                             self.decoder.top_k, self.decoder.num_layers if self.decoder.moe else 0)
            chunk_samples = self._run_chunk(prompt_ids, prompts, chunk, picker.longest, picker, config)
            if self.decoder.moe:
                for c, sample in enumerate(chunk_samples):
                    sample.metadata["routing"] = picker.recorded(c)
            samples.extend(chunk_samples)
        for s in samples:
            s.sampler_logprobs_scaled = None
            s.metadata["teacher_forced"] = True
        return samples

    def _check_routing(self, routing: Sequence[torch.Tensor] | None, forced: list[list[int]]
                       ) -> list[torch.Tensor] | None:
        """``teacher_forced``'s ``routing``: one ``[len(response) - 1, layers, top_k]`` tensor of expert ids per pair."""
        if routing is None:
            return None
        d = self.decoder
        if not d.moe:
            raise ValueError("teacher_forced: routing was given but the model is not a mixture of experts")
        if len(routing) != len(forced):
            raise ValueError(f"teacher_forced: routing must hold one tensor per pair ({len(forced)}); got {len(routing)}")
        experts = self.model.config.num_experts
        out = []
        for i, (r, resp) in enumerate(zip(routing, forced)):
            r = torch.as_tensor(r, dtype=torch.long)
            want = (len(resp) - 1, d.num_layers, d.top_k)
            if tuple(r.shape) != want:
                raise ValueError(f"teacher_forced: routing[{i}] has shape {tuple(r.shape)}; need {list(want)} "
                                 "(response length - 1, layers, experts per token)")
            if r.numel() and (int(r.min()) < 0 or int(r.max()) >= experts):
                raise ValueError(f"teacher_forced: routing[{i}] names experts outside [0, {experts})")
            out.append(r)
        return out

    def _check_resumed(self, what: str, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        released = [p for p in parts if p in self._released]
        if released:
            raise RuntimeError(f"HFRolloutEngine.{what} called after release_memory() with {', '.join(released)} "
                               f"still released; call resume_memory() first")

    def _encode(self, prompt: str | list[int], index: int) -> list[int]:
        return encode_prompt(prompt, index, self.tokenizer, self.model.config.vocab_size)

    def _eos_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        return sorted(ids)

    def _newline_mask(self) -> torch.Tensor:
        """[V] bool: tokens whose text contains a newline (for ``trigger_on_newline``)."""
        if self._newline_ids is None:
            if self.tokenizer is None:
                raise ValueError("CompressionConfig.trigger_on_newline needs a tokenizer to find newline tokens")
            vocab = self.model.config.vocab_size
            texts = self.tokenizer.batch_decode([[i] for i in range(vocab)])
            self._newline_ids = torch.tensor(["\n" in t for t in texts], dtype=torch.bool)
        return self._newline_ids

    def _new_cache(self, rows: int, capacity: int, config: CompressionConfig) -> CompressedKVCache:
        d = self.decoder
        return CompressedKVCache(
            num_layers=d.num_layers, rows=rows, num_kv_heads=d.num_kv_heads, num_q_heads=d.num_q_heads,
            head_dim=d.head_dim, capacity=capacity, dtype=self.dtype, config=config,
            scaling=d.scaling, device=self.device, rope_inv_freq=d.inv_freq,
            centers=load_centers(config.triattention_centers_path) if config.uses_center_file else None)

    def _run_chunk(self, prompt_ids, prompts, chunk, max_new: int, picker, config: CompressionConfig,
                   prefix_lens: list[int] | None = None) -> list[Sample]:
        """Prefill the chunk's distinct prompts once, expand to its rows, then decode in lockstep with the KV
        compression ``config``; ``picker`` chooses each row's next token (sampled or forced) and when the row stops.
        ``prefix_lens[g]``: the last tokens of ``prompt_ids[g]`` that are a continued response's (``generate``)."""
        device = self.device
        schedule = CompressionSchedule(config)
        groups = sorted({g for g, _ in chunk})
        lens = torch.tensor([len(prompt_ids[g]) for g in groups], device=device)
        longest = int(lens.max()) + max_new
        if self.decoder.max_positions is not None and longest > self.decoder.max_positions:
            raise ValueError(
                f"prompt ({int(lens.max())}) + max_new_tokens ({max_new}) exceeds the model's "
                f"max_position_embeddings ({self.decoder.max_positions})")
        width = align_keys(int(lens.max()))  # padded prompt width and capacity: see kv_cache.KEY_ALIGN
        capacity = align_keys(max(width, *(schedule.capacity(int(p), max_new) for p in lens)))
        padded = torch.zeros(len(groups), width, dtype=torch.long, device=device)
        for r, g in enumerate(groups):
            padded[r, : len(prompt_ids[g])] = torch.tensor(prompt_ids[g], device=device)

        cache = self._new_cache(len(groups), capacity, config)
        logits = self.decoder.prefill(padded, lens, cache)
        if prefix_lens is not None:
            cache.set_response_start(lens - torch.tensor([prefix_lens[g] for g in groups], device=device))
        record = self.decoder.moe and (self.record_routing or isinstance(picker, _Forced))
        prompt_routes = self.decoder.prefill_routing.to("cpu", ROUTE_DTYPE) if record else None  # [G, P, L, k]
        cache.maybe_compress_after_prefill()
        expand = torch.tensor([groups.index(g) for g, _ in chunk], device=device)
        cache.select_rows(expand)
        logits = logits.index_select(0, expand)

        tokens: list[list[int]] = [[] for _ in chunk]
        lp: list[list[float]] = [[] for _ in chunk]
        lp_scaled: list[list[float]] = [[] for _ in chunk]
        reasons: list[str | None] = [None] * len(chunk)
        stats: dict[int, tuple[int, int, str | None]] = {}
        fed_routes: list[list[torch.Tensor]] = [[] for _ in chunk]  # per chunk row: [L, k] per fed response token
        active = list(range(len(chunk)))       # chunk index of every cache row, in row order
        finished = [False] * len(active)      # finished rows stay in the batch until the next compaction
        newline = self._newline_mask().to(device) if config.trigger_on_newline and schedule.enabled else None
        bar = self._progress(max_new, len(chunk), config)
        with bar:
            for step in range(max_new):
                tok, lp1, lps = picker.pick(logits, active, step)
                tok_list, lp1_list, lps_list = tok.tolist(), lp1.tolist(), lps.tolist()
                for row, c in enumerate(active):
                    if finished[row]:
                        continue
                    tokens[c].append(tok_list[row])
                    lp[c].append(lp1_list[row])
                    lp_scaled[c].append(lps_list[row])
                    reasons[c] = picker.check(c, tokens[c])
                    if reasons[c] is not None:
                        finished[row] = True
                        stats[c] = self._row_stats(cache, row)
                bar.update(1)
                n_done = sum(finished)
                if n_done == len(active):
                    break
                if n_done * _COMPACT_FRACTION >= len(active):
                    index = torch.tensor([row for row, f in enumerate(finished) if not f], device=device)
                    cache.select_rows(index)
                    tok = tok.index_select(0, index)
                    active = [active[row] for row in index.tolist()]
                    finished = [False] * len(active)
                logits = self.decoder.decode(tok, cache, picker.forced_routing(active, step))
                picker.record(active, step, self.decoder.last_routing)
                if record:  # a row whose last token was just picked is fed too; that token routes nothing scored
                    step_routes = self.decoder.last_routing.to("cpu", ROUTE_DTYPE)
                    for row, c in enumerate(active):
                        if not finished[row]:
                            fed_routes[c].append(step_routes[row])
                cache.maybe_compress_after_decode(None if newline is None else newline[tok])
                if self.show_progress:
                    bar.set_postfix(running=len(active) - sum(finished), kv=int(cache.lens.max()))
        prompt_of = (lambda g: prompt_ids[g]) if prefix_lens is None else \
            (lambda g: prompt_ids[g][:len(prompt_ids[g]) - prefix_lens[g]])
        samples = [self._make_sample(prompt_of(g), prompts[g], g, i, tokens[c], lp[c], lp_scaled[c], reasons[c],
                                     stats[c], config) for c, (g, i) in enumerate(chunk)]
        if record:
            for c, (g, _) in enumerate(chunk):
                prompt = prompt_routes[groups.index(g), :len(prompt_ids[g])]
                fed = fed_routes[c][:max(len(tokens[c]) - 1, 0)]
                samples[c].routed_experts = torch.cat([prompt, torch.stack(fed)]) if fed else prompt.clone()
        return samples

    @staticmethod
    def _row_stats(cache: CompressedKVCache, row: int) -> tuple[int, int, str | None]:
        digest = cache.digests[row].hexdigest() if cache.digests is not None else None
        return int(cache.events[row]), int(cache.peak[row]), digest

    def _progress(self, total: int, rows: int, config: CompressionConfig):
        if not self.show_progress:
            return _NullBar()
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=f"rollout x{rows} ({config.describe()})", unit="tok", leave=False)

    def _make_sample(self, prompt_ids, prompt, group, index, tokens, lp, lp_scaled, reason, stats,
                     c: CompressionConfig) -> Sample:
        events, peak, digest = stats
        info = CompressionInfo(
            method=c.method, budget=None if c.is_dense else c.budget, window=0 if c.is_dense else c.window,
            buffer=0 if c.is_dense else c.buffer, scope=c.scope, events=events, peak_kv_tokens=peak,
            kept_digest=digest)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return Sample(
            prompt_ids=list(prompt_ids), response_ids=tokens,
            sampler_logprobs=torch.tensor(lp, dtype=torch.float32),
            sampler_logprobs_scaled=torch.tensor(lp_scaled, dtype=torch.float32),
            response_text=decode(tokens, skip_special_tokens=True) if decode else "",
            prompt_text=prompt if isinstance(prompt, str) else (decode(prompt_ids) if decode else ""),
            finish_reason=reason or "length", group_id=group, index_in_group=index,
            weight_version=self.weight_version, compression=info)


class _NullBar(contextlib.nullcontext):
    def update(self, *_):
        pass

    def set_postfix(self, **_):
        pass


class _Sampler:
    """``generate``'s token choice: draw from the sampling distribution (per-sample uniforms); stop on
    EOS, a stop string or the length limit."""

    def __init__(self, sampling: SamplingParams, seed: int, chunk, stopper: StopChecker,
                 prefixes: list[list[int]] | None = None):
        self.sampling = sampling
        self.stopper = stopper
        self.prefixes = prefixes
        self.uniforms = torch.stack([draw_uniforms(seed, g, i, sampling.max_new_tokens) for g, i in chunk])

    def pick(self, logits: torch.Tensor, active: list[int], step: int):
        """logits [R, V] of the active rows -> tokens [R], T=1 log-probs [R], sampled-distribution log-probs [R]."""
        return sample_tokens(logits, self.uniforms[active, step], self.sampling)

    def check(self, c: int, tokens: list[int]) -> str | None:
        return self.stopper.check(tokens, () if self.prefixes is None else self.prefixes[c])

    def forced_routing(self, active: list[int], step: int) -> None:
        """Sampling routes every token by the router's choice."""
        return None

    def record(self, active: list[int], step: int, routing: torch.Tensor | None) -> None:
        """Sampling keeps no routing."""


class _Forced:
    """``teacher_forced``'s token choice: the given response token of each row; a row stops after its last one.
    For a mixture of experts it keeps the experts each fed response token went to (``recorded``) and, given
    ``routing``, replays them."""

    def __init__(self, responses: list[list[int]], routing: list[torch.Tensor] | None = None, top_k: int = 0,
                 layers: int = 0):
        self.responses = responses
        self.longest = max(len(r) for r in responses)
        self.routing = routing
        self.top_k = top_k
        self._kept = [torch.zeros(len(r) - 1, layers, top_k, dtype=torch.long) for r in responses] if layers else None

    def forced_routing(self, active: list[int], step: int) -> torch.Tensor | None:
        """``[R, layers, top_k]`` experts of this step's fed tokens (rows already past their response: any)."""
        if self.routing is None:
            return None
        filler = torch.arange(self.top_k).expand(self.routing[0].shape[1], self.top_k)
        return torch.stack([self.routing[c][step] if step < len(self.routing[c]) else filler for c in active])

    def record(self, active: list[int], step: int, routing: torch.Tensor | None) -> None:
        if routing is None or self._kept is None:
            return
        routing = routing.cpu()
        for row, c in enumerate(active):
            if step < len(self._kept[c]):
                self._kept[c][step] = routing[row]

    def recorded(self, c: int) -> torch.Tensor:
        """``[len(response) - 1, layers, top_k]``: the experts row ``c``'s fed response tokens went to."""
        return self._kept[c]

    def pick(self, logits: torch.Tensor, active: list[int], step: int):
        tok = torch.tensor([self.responses[c][min(step, len(self.responses[c]) - 1)] for c in active],
                           device=logits.device)
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tok[:, None]).squeeze(-1)
        return tok, lp, lp

    def check(self, c: int, tokens: list[int]) -> str | None:
        return "length" if len(tokens) >= len(self.responses[c]) else None
