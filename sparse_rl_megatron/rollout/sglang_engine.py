"""The SGLang rollout engine: GRPO groups sampled by SGLang with the ``sparse_kv`` plugin (compressed KV).

It implements :class:`~sparse_rl_megatron.rollout.engine_protocol.RolloutEngine` like the HF reference engine and
returns the same :class:`Sample` fields, so the trainer and the evaluator take either:

- **Log-prob convention.** ``Sample.sampler_logprobs`` are the *T=1, unfiltered* log-probs of the sampled
  tokens, ``log_softmax(logits)[y_t]`` (as the HF engine's; Sparse-RL's ratio needs pi_sparse at T=1).
  SGLang returns temperature-scaled ones unless ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; the in-process engine
  and ``python -m sglang_ext.launch_server`` set it, and every response carries the convention the server
  used (``meta_info['sparse_kv']['logprobs']``): a server answering ``scaled`` is refused unless the request
  was sampled at temperature 1 without top-k/top-p (where both agree). ``sampler_logprobs_scaled`` is None.
- **Provenance.** ``Sample.compression`` comes from the plugin (method, B, alpha, W, scope, events, peak
  retained tokens, kept digest). ``Sample.weight_version`` is checked against the version SGLang reports
  for the request (``meta_info['weight_version']``, set by every weight update here): a sample never claims
  weights it was not sampled with; a request whose weights changed mid-flight is an error.
- **Retraction.** When the KV pool runs short SGLang retracts running requests and re-prefills them later. The
  plugin admits every compressed request by its exact remaining need and retracts dense requests first
  (``sglang_ext/admission.py``), so a compressed request is never retracted for lack of KV slots: each sample is
  its request's first draw, and the response lengths are those of an unpressured run. Dense requests, and
  compressible ones before their first compression (their KV is still dense, rebuilt exactly), may be retracted and
  resume. A request retracted after its first compression all the same (priority preemption) is refused by the
  plugin (its compressed KV cannot be rebuilt) and resubmitted as a fresh sample (``max_resubmits``, counted in
  ``resubmitted``); a redraw would bias a step towards short responses (SGLang retracts the requests with the
  fewest output tokens first). Each sample's ``metadata`` counts its retractions (``retractions``, the last
  draw's) and the fresh draws before it (``redraws``); the trainer logs them (``rollout/retractions``,
  ``rollout/redraws``) and the fractions of samples with any (``rollout/retracted_frac``, ``rollout/redrawn_frac``).
- **Seeds.** Each request carries a ``sampling_seed`` from ``(SamplingParams.seed, group id, index)`` when
  ``SGLangEngineConfig.request_seeds`` says so (default: the in-process CPU engine), but SGLang 0.5.23 honours it
  only with ``enable_deterministic_inference``, which refuses any attention backend outside its deterministic list,
  the ``sparse_kv`` plugin's included: samples are drawn from the scheduler's own RNG (``random_seed``), so the same
  seed does not repeat them, whatever the batch or the number of engines (``bench/bench_engine_shards.py``); SGLang
  and the HF engine draw different tokens.

Weights: ``update_weights`` takes HF-named full tensors (or the learner's buckets, lists of them) and sends
them between ``begin/end_weight_update`` (``tensor``, in-process), over a process group (``distributed``,
gloo on CPU / NCCL on GPU, any node) or through safetensors files (``disk``); then SGLang flushes its prefix
cache, verified: a flush SGLang could not do (the engine not idle within ``flush_timeout_s``) fails the update in
one line and blocks sampling until a later flush succeeds, so no KV computed with old weights is reused.
``release_memory`` / ``resume_memory`` map to SGLang's ``release/resume_memory_occupation`` (they free memory only
on CUDA with ``memory_saver``; no-ops on CPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Iterable, Sequence

import torch

from sparse_rl_megatron.compression import CompressionConfig
from sparse_rl_megatron.rollout.engine_protocol import (
    ENGINE_MEMORY_PARTS, SamplingParams, check_group_ids, check_memory_parts, check_prefixes, encode_prompt,
)
from sparse_rl_megatron.rollout.sample import CompressionInfo, Sample
from sparse_rl_megatron.rollout.sampling import sample_seed
from sparse_rl_megatron.rollout.sglang_client import CacheNotFlushed, InProcessClient
from sparse_rl_megatron.rollout.sglang_config import SGLangEngineConfig
from sparse_rl_megatron.rollout.sglang_weights import SGLangWeightTransport
from sparse_rl_megatron.rollout.weights import iter_buckets

_SEED_MOD = 2**31 - 1  # SGLang's sampling_seed is a 32-bit signed int
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for its ranks (plus every ``TORCHELASTIC_*``), hidden from the engine's processes: with
``TORCHELASTIC_USE_AGENT_STORE=True`` inherited, a scheduler's own ``init_process_group`` only connects to a store
it expects torchrun's agent to host at its port, which nobody does, and waits there for its full timeout."""


@contextlib.contextmanager
def _without_torchrun_env():
    """Hide torchrun's variables from the processes started inside the block (spawned children copy the
    environment when they start), then restore them for this rank."""
    names = [k for k in os.environ if k in TORCHRUN_VARIABLES or k.startswith("TORCHELASTIC_")]
    saved = {k: os.environ.pop(k) for k in names}
    try:
        yield
    finally:
        os.environ.update(saved)


def scored_ids_match(reported: Sequence[int], response: Sequence[int], vocab_size: int | None) -> bool:
    """Whether SGLang's ``input_token_logprobs`` ids (``reported``) are ``response``'s. SGLang 0.5 reports every id
    ``>= vocab_size - 1`` as 0 there (a clip meant for image-placeholder hashes, one id too wide: the values are the
    scored token's), so such an id matches a reported 0; with ``vocab_size`` unknown any reported 0 does."""
    if len(reported) != len(response):
        return False
    bound = -1 if vocab_size is None else vocab_size - 1
    return all(r == t or (r == 0 and t >= bound) for r, t in zip(reported, response))


TEXT_CONFIG_KEYS = ("thinker_config", "llm_config", "language_config", "text_config")
"""Where SGLang looks for a model's text config, first match wins (else the top level)."""


def config_vocab_size(config: dict) -> int | None:
    """The vocabulary size SGLang serves for an HF ``config.json``'s contents: its text config's (``TEXT_CONFIG_KEYS``,
    a thinker's own ``text_config`` inside it), else the top level's; None when none is stated."""
    text = config
    for key in TEXT_CONFIG_KEYS:
        if isinstance(config.get(key), dict):
            text = config[key]
            if key == "thinker_config" and isinstance(text.get("text_config"), dict):
                text = text["text_config"]
            break
    size = text.get("vocab_size", config.get("vocab_size"))
    return None if size is None else int(size)


def _config_vocab_size(model_path: str) -> int | None:
    if not model_path:   # HTTP servers given by urls alone
        return None
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return config_vocab_size(json.load(f))


class SGLangRolloutEngine:
    """A :class:`~sparse_rl_megatron.rollout.engine_protocol.RolloutEngine` on SGLang (see the module docstring).

    Use as a context manager, or call :meth:`shutdown`.
    """

    def __init__(self, config: SGLangEngineConfig, *, weight_version: int = 0):
        self.config = config
        self.weight_version = weight_version
        self.tokenizer = self._load_tokenizer()
        self.vocab_size = _config_vocab_size(config.model_path)
        """The model's vocabulary size from ``model_path``'s ``config.json`` (None without one)."""
        self._released: set[str] = set()  # ENGINE_MEMORY_PARTS not resumed since release_memory
        self._cache_stale = False
        """Weights changed and the radix caches were not flushed yet (``_weights_loaded``)."""
        self.resubmitted = 0
        """Requests resubmitted after a refused retraction, over this engine's life."""
        if config.urls:
            from sparse_rl_megatron.rollout.sglang_client import HttpClient

            self.client = HttpClient(config.urls, timeout_s=config.request_timeout_s,
                                     startup_timeout_s=config.startup_timeout_s, retries=config.request_retries,
                                     health_check_s=config.health_check_s)
            self.client.align_weight_version(str(weight_version))
            self._per_request = config.compression
            on_cpu = False
        else:
            self.client, on_cpu = self._start_in_process()
            self._per_request = None  # the in-process server's default is config.compression
        self.request_seeds = on_cpu if config.request_seeds is None else config.request_seeds
        """Requests carry a ``sampling_seed`` (``SGLangEngineConfig.request_seeds``; see the module docstring)."""
        self.weights = SGLangWeightTransport(config, self.client)
        """Moves weights into the servers by ``config.weight_sync`` (``sglang_weights.py``)."""

    # ------------------------------------------------------------------------------------------ set-up
    def _load_tokenizer(self):
        path = self.config.tokenizer_path or self.config.model_path
        if not path or not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)

    def _start_in_process(self) -> tuple[Any, bool]:
        """The in-process engine's client, and whether it runs on CPU."""
        from sglang_ext import cpu_compat
        from sglang_ext.config import BACKEND_NAME, CONFIG_ENV, scheduler_env

        c = self.config
        on_cpu = cpu_compat.apply()
        kwargs: dict[str, Any] = dict(cpu_compat.cpu_engine_kwargs()) if on_cpu else {
            "disable_cuda_graph": True, "enable_memory_saver": c.memory_saver, "base_gpu_id": c.base_gpu_id}
        kwargs.update(model_path=c.model_path, dtype=c.dtype, tp_size=c.tp_size, random_seed=c.random_seed or 0,
                      log_level=c.log_level, attention_backend=BACKEND_NAME, page_size=1,
                      disable_radix_cache=not c.radix_cache, weight_version=str(self.weight_version))
        for name in ("max_total_tokens", "mem_fraction_static", "max_running_requests"):
            if getattr(c, name) is not None:
                kwargs[name] = getattr(c, name)
        if on_cpu and c.max_total_tokens is None:  # a recipe's GPU mem_fraction_static would claim most of the RAM
            kwargs["max_total_tokens"] = cpu_compat.CPU_DEFAULT_POOL_TOKENS
        if on_cpu and c.max_running_requests is None:  # the plugin reserves its per-row memory for every row
            kwargs["max_running_requests"] = cpu_compat.CPU_DEFAULT_RUNNING_REQUESTS
        kwargs.update(c.extra_args)
        with _without_torchrun_env(), scheduler_env(**{CONFIG_ENV: c.plugin_config().to_json(),
                                                       "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}):
            return InProcessClient(kwargs), on_cpu

    # ----------------------------------------------------------------------------------------- generate
    def generate(self, prompts: Sequence[str | list[int]], n: int, sampling: SamplingParams, *,
                 compression: CompressionConfig | None = None, group_ids: Sequence[int] | None = None,
                 budgets: Sequence[int] | None = None, prefixes: Sequence[Sequence[int]] | None = None
                 ) -> list[Sample]:
        """``n`` samples per prompt, group-major, ``group_id`` = ``group_ids[p]`` (default: the prompt index),
        which also picks each request's sampling seed. ``compression`` overrides the engine's for these requests
        (within the server's window and B + W); ``budgets[p]`` is prompt p's own budget B (its requests decode
        beside the others, and the plugin admits each by its own B + W + 1 future tokens). ``prefixes[p]`` continues
        prompt p's response (a carried partial rollout): prompt + prefix is the request's input (a plain prefill, so
        only ``scope: all`` budgets it as the reference engine does; stop strings are refused, SGLang matches them
        on the new text only)."""
        self._check_resumed("generate")
        if n < 1:
            raise ValueError(f"generate: n must be >= 1; got {n}")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer (the engine has none); pass token ids only")
        self._flush_stale_cache()
        gids = check_group_ids(group_ids, len(prompts))
        prompt_ids = dict(zip(gids, (encode_prompt(p, i, self.tokenizer) for i, p in enumerate(prompts))))
        texts = dict(zip(gids, prompts))
        overrides = compression if compression is not None else self._per_request
        inputs = self._continued(prompt_ids, gids, check_prefixes(prefixes, len(prompts)), sampling,
                                 compression or self.config.compression)
        per_group = self._budget_overrides(compression or self.config.compression, budgets, gids, overrides)
        todo = [(g, i) for g in gids for i in range(n)]
        done: dict[tuple[int, int], Sample] = {}
        for attempt in range(self.config.max_resubmits + 1):
            outs = self.client.generate([inputs[g] for g, _ in todo],
                                        [self._sampling(sampling, g, i, attempt, per_group[g]) for g, i in todo],
                                        groups=[g for g, _ in todo])
            retry = []
            for (g, i), out in zip(todo, outs):
                if self._refused(out):
                    retry.append((g, i))
                else:
                    done[(g, i)] = sample = self._sample(out, prompt_ids[g], texts[g], g, i, sampling)
                    sample.metadata["redraws"] = attempt   # fresh draws after refused retractions
            if not retry:
                break
            self.resubmitted += len(retry)
            todo = retry
        else:
            raise RuntimeError(f"{len(todo)} request(s) were refused after retractions {self.config.max_resubmits + 1} "
                               "times; enlarge the KV pool or lower max_running_requests")
        return [done[(g, i)] for g in gids for i in range(n)]

    @staticmethod
    def _continued(prompt_ids: dict[int, list[int]], gids: list[int], prefixes: list[list[int]] | None,
                   sampling: SamplingParams, compression: CompressionConfig) -> dict[int, list[int]]:
        """Each group's request input: its prompt, followed by its ``prefixes`` entry when a response is continued."""
        if prefixes is None:
            return prompt_ids
        if sampling.stop:
            raise ValueError("generate: prefixes (a continued response) with SamplingParams.stop on the sglang engine: "
                             "SGLang matches stop strings on the new text only; valid: no stop strings, or engine hf")
        if not compression.is_dense and compression.scope == "response":
            raise ValueError("generate: prefixes (a continued response) need compression.scope: all on the sglang "
                             "engine (the plugin counts a prefilled response as prompt); valid: scope all, or engine hf")
        return {g: prompt_ids[g] + pre for g, pre in zip(gids, prefixes)}

    def _budget_overrides(self, base: CompressionConfig, budgets: Sequence[int] | None, gids: list[int],
                          overrides: CompressionConfig | None) -> dict[int, CompressionConfig | None]:
        """Each group's request compression: ``overrides``, or ``base`` with the group's budget from ``budgets``."""
        if budgets is None:
            return {g: overrides for g in gids}
        if len(budgets) != len(gids):
            raise ValueError(f"generate: budgets must hold one budget per prompt ({len(gids)}); got {len(budgets)}")
        if base.is_dense:
            raise ValueError("generate: budgets were given but the compression is dense (method 'none')")
        server = self.config.compression
        per_group = {}
        for g, b in zip(gids, budgets):
            config = dataclasses.replace(base, budget=b)  # validated: B > window, an int
            if not server.is_dense and config.max_candidates > server.max_candidates:
                raise ValueError(f"generate: budget {b} + buffer {config.buffer} exceeds the server's B + W "
                                 f"({server.max_candidates}), which sizes its tables")
            per_group[g] = config
        return per_group

    def dense_logprobs(self, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """``[len(response)]`` T=1 log-probs of each given response after its prompt, under full attention
        (compression off for these requests; one prefill each, at temperature 1 so SGLang's input log-probs
        are unscaled). The weight-sync probe's engine side."""
        self._check_resumed("dense_logprobs")
        ids = [list(map(int, p)) + list(map(int, r)) for p, r in zip(prompts, responses)]
        if any(len(p) < 1 for p in prompts):
            raise ValueError("dense_logprobs: every prompt needs at least one token")
        self._flush_stale_cache()
        params = self._sampling(SamplingParams(temperature=1.0, max_new_tokens=1), 0, 0, 0,
                                CompressionConfig())
        outs = self.client.generate(ids, [dict(params) for _ in ids], groups=list(range(len(ids))),
                                    logprob_start_len=[len(p) - 1 for p in prompts])
        result = []
        for j, (out, response) in enumerate(zip(outs, responses)):
            self._check_version(out["meta_info"], j, 0)
            triples = out["meta_info"]["input_token_logprobs"][1:]  # the first is the last prompt token's: None
            if not scored_ids_match([int(t) for _, t, _ in triples], [int(t) for t in response], self.vocab_size):
                raise RuntimeError(f"dense_logprobs: SGLang scored other tokens than response {j}'s")
            result.append(torch.tensor([float(lp) for lp, _, _ in triples], dtype=torch.float32))
        return result

    def with_compression(self, compression: CompressionConfig) -> "CompressionView":
        """This engine (same servers, same live weights) sampling with another KV compression per request."""
        return CompressionView(self, compression)

    def _sampling(self, s: SamplingParams, group: int, index: int, attempt: int,
                  compression: CompressionConfig | None) -> dict:
        """SGLang's sampling parameters of one request; ``compression``: the request's own (None: the in-process
        server's default)."""
        params: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p,
                                  "top_k": s.top_k if s.top_k > 0 else -1, "max_new_tokens": s.max_new_tokens,
                                  "ignore_eos": s.ignore_eos, "no_stop_trim": True}
        if s.stop:
            params["stop"] = list(s.stop)
        if s.seed is not None and self.request_seeds:
            params["sampling_seed"] = (sample_seed(s.seed, group, index) + attempt) % _SEED_MOD
        if compression is not None:
            from sglang_ext.config import request_params

            params["custom_params"] = request_params(compression)
        return params

    @staticmethod
    def _refused(out: dict) -> bool:
        from sglang_ext.hooks import REFUSED_RETRACTION

        reason = out["meta_info"].get("finish_reason") or {}
        return reason.get("type") == "abort" and reason.get("message") == REFUSED_RETRACTION

    def _sample(self, out: dict, prompt_ids: list[int], prompt, group: int, index: int,
                sampling: SamplingParams) -> Sample:
        from sglang_ext.config import REQUEST_KEY

        meta = out["meta_info"]
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise RuntimeError(f"SGLang aborted request {group}/{index}: {reason.get('message')}")
        info = (meta.get(REQUEST_KEY) or [None])[0]
        if info is None:
            raise RuntimeError("the SGLang server does not run the sparse_kv plugin (no provenance in meta_info); "
                               "start it with python -m sglang_ext.launch_server")
        filtered = sampling.temperature not in (0.0, 1.0) or sampling.top_k > 0 or sampling.top_p < 1.0
        if info.get("logprobs") != "t1" and filtered:
            raise RuntimeError("the SGLang server returns temperature-scaled log-probs; start it with "
                               "SGLANG_RETURN_ORIGINAL_LOGPROB=1 (sglang_ext.launch_server does)")
        self._check_version(meta, group, index)
        triples = meta["output_token_logprobs"]
        tokens = [int(t) for _, t, _ in triples]
        logprobs = torch.tensor([float(lp) for lp, _, _ in triples], dtype=torch.float32)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return Sample(
            prompt_ids=list(prompt_ids), response_ids=tokens, sampler_logprobs=logprobs,
            response_text=decode(tokens, skip_special_tokens=True) if decode else "",
            prompt_text=prompt if isinstance(prompt, str) else (decode(prompt_ids) if decode else ""),
            finish_reason=self._finish_reason(reason), group_id=group, index_in_group=index,
            weight_version=self.weight_version,
            compression=CompressionInfo(
                method=info["method"], budget=info["budget"], window=info["window"], buffer=info["buffer"],
                scope=info["scope"], events=int(info["events"]), peak_kv_tokens=int(info["peak_kv_tokens"]),
                kept_digest=info["kept_digest"]),
            metadata={"engine": "sglang", "retractions": int(info.get("retractions", 0))})

    def _check_version(self, meta: dict, group: int, index: int) -> None:
        spans = meta.get("weight_versions") or []   # [{version, start, end}] over the output tokens
        versions = {str(span["version"]) for span in spans}
        if meta.get("weight_version") is not None:
            versions.add(str(meta["weight_version"]))
        if len(versions) > 1:
            raise RuntimeError(f"request {group}/{index} was sampled across a weight update ({spans}); its "
                               "sample would mix two policies")
        if versions and versions != {str(self.weight_version)}:
            raise RuntimeError(f"request {group}/{index} was sampled with weight version {versions.pop()}, but the "
                               f"engine is at version {self.weight_version}; another client updated the server?")

    @staticmethod
    def _finish_reason(reason: dict) -> str:
        kind = reason.get("type")
        if kind == "length":
            return "length"
        if kind == "stop":
            return "stop" if isinstance(reason.get("matched"), str) else "eos"
        return str(kind)

    # ------------------------------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable, version: int) -> None:
        """Load HF-named full tensors (pairs or buckets of pairs, possibly lazy: streamed bucket by bucket) into
        every server and set the version. ``disk`` sync needs every weight in one call."""
        self.weights.push(iter_buckets(named_tensors), str(version))
        self._weights_loaded(version)

    def update_weights_from_payloads(self, payloads: Iterable[list], version: int) -> None:
        """In-process engine: load buckets serialized once per TP rank (``payloads``: per bucket, a list of
        ``tp_size`` payloads from ``sglang_weights.serialize_bucket``; TP rank r opens only the r-th). A colocated
        engine on several GPUs gets each TP rank's payload from the learner rank on that GPU (CUDA IPC: no copy
        through the host, none across GPUs). Lazy streams are consumed bucket by bucket."""
        if not self.config.takes_payloads:
            raise RuntimeError("update_weights_from_payloads needs the in-process engine with weight_sync 'tensor'")
        self.weights.push_payloads(payloads, str(version))
        self._weights_loaded(version)

    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Reload every server from an HF directory visible to it."""
        self.weights.reload(model_path, str(version))
        self._weights_loaded(version)

    def _weights_loaded(self, version: int) -> None:
        """Every server runs ``version`` now: flush the prompt KV the old weights computed out of their radix trees
        before anything is sampled. SGLang flushes only an idle engine (a request still queued or running defers
        it, e.g. one whose abort is not yet processed) and retries the flush at every scheduler step for
        ``flush_timeout_s``; if the engine never went idle the update fails here in one line, and ``generate`` tries
        the flush again before it samples (so no sample reuses prompt KV of the old weights). Before issue 41 a
        flush refused that way went unnoticed: the next step reused the old weights' prompt KV (off-policy samples)."""
        self.weight_version = version
        self._cache_stale = True
        self._flush_stale_cache()

    def _flush_stale_cache(self) -> None:
        if not self._cache_stale:
            return
        try:
            self.client.flush_cache(self.config.flush_timeout_s)
        except CacheNotFlushed as err:
            raise CacheNotFlushed(f"weight version {self.weight_version}: {err}; nothing is sampled until a flush "
                                  "succeeds, or prompt KV of the old weights would be reused "
                                  "(rollout.sglang.flush_timeout_s)") from None
        self._cache_stale = False

    # ------------------------------------------------------------------------------------------- memory
    def release_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        """Free ``parts`` of SGLang's memory (its tags: ``weights``; ``kv_cache`` with the captured graphs) while the
        learner uses the GPU (CUDA with ``memory_saver``; on CPU SGLang only records them); a part already released
        is skipped (SGLang would pause its memory twice)."""
        todo = [p for p in check_memory_parts(parts, "SGLangRolloutEngine.release_memory") if p not in self._released]
        if todo:
            self.client.release_memory(todo)
            self._released |= set(todo)

    def resume_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        """Take back ``parts`` (SGLang's memory tags: ``weights``; ``kv_cache`` with the captured graphs); a part
        that is not released is skipped (SGLang refuses to resume a tag twice)."""
        todo = [p for p in check_memory_parts(parts, "SGLangRolloutEngine.resume_memory") if p in self._released]
        if todo:
            self.client.resume_memory(todo)
            self._released -= set(todo)

    def _check_resumed(self, what: str) -> None:
        if self._released:
            raise RuntimeError(f"SGLangRolloutEngine.{what} called after release_memory() with "
                               f"{', '.join(sorted(self._released))} still released; call resume_memory() first")

    def shutdown(self) -> None:
        try:
            self.weights.close()
        finally:
            self.client.shutdown()

    def __enter__(self) -> "SGLangRolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class CompressionView:
    """An :class:`SGLangRolloutEngine` whose ``generate`` uses another KV compression (e.g. dense evaluation of a
    sparse-rollout server); weights, version, memory state and shutdown are the engine's (a view owns nothing)."""

    def __init__(self, engine: SGLangRolloutEngine, compression: CompressionConfig):
        self.engine, self.compression = engine, compression

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts: Sequence[str | list[int]], n: int, sampling: SamplingParams, *,
                 group_ids: Sequence[int] | None = None, compression: CompressionConfig | None = None,
                 budgets: Sequence[int] | None = None, prefixes: Sequence[Sequence[int]] | None = None
                 ) -> list[Sample]:
        """The engine's ``generate`` with this view's compression (``compression``, when given, replaces it)."""
        return self.engine.generate(prompts, n, sampling, compression=compression or self.compression,
                                    group_ids=group_ids, budgets=budgets, prefixes=prefixes)

    def dense_logprobs(self, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return self.engine.dense_logprobs(prompts, responses)

    def with_compression(self, compression: CompressionConfig) -> "CompressionView":
        return CompressionView(self.engine, compression)

    def update_weights(self, named_tensors: Iterable, version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def update_weights_from_payloads(self, payloads: Iterable[list], version: int) -> None:
        self.engine.update_weights_from_payloads(payloads, version)

    def release_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        self.engine.release_memory(parts)

    def resume_memory(self, parts: Sequence[str] = ENGINE_MEMORY_PARTS) -> None:
        self.engine.resume_memory(parts)

    def shutdown(self) -> None:
        """Nothing: the engine is shut down by its owner."""
