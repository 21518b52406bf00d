"""What the ``sparse_kv`` backend refuses before the server serves, each in one line naming the flag or fact.

Two stages, each with tables of :class:`Rule` (``refusals()`` lists every name per stage; the README's list is
checked against it):

- **arguments**, when SGLang resolves the server arguments, before any model loads. ``ARGUMENT_RULES`` (the server
  flags) and ``MODEL_RULES`` (facts of the model's config, read from its ``config.json`` as SGLang reads it) run
  twice: before SGLang resolves its arguments (``ServerArgs.resolve_once``, on the fields as given: SGLang's own
  resolution rewrites some of them, ``--enable-dp-attention`` becomes ``attn_dp_size`` and is cleared, or rejects
  them first with a message about something else: unified memory, PD multiplexing, two-batch overlap, a hybrid
  linear-attention model on CPU), and after ``ServerArgs.check_server_args``, on the resolved values (what the
  scheduler will run with);
- **model load**, when the scheduler builds the backend on its model runner (``RUNNER_RULES``, from
  ``SparseKVBackend.__init__``; before the server serves): what only the loaded model and its KV pool show (a
  sliding window set by the model's code, the pool class SGLang picked, the KV dtype it resolved); plus the index translator
  (``runner_view.physical_translator``) and one backend per process (``backend._claim_process``).

First of all, at both stages and in ``sglang_ext.launch_server`` before SGLang is imported: an attention backend
other than ``sparse_kv`` beside a sparse_kv config (``refuse_other_backend``; SGLang would serve dense and ignore it).

Why each is refused: the plugin keeps one physical table per request row and one attention backend per process; it
reads and writes the KV pool by the slot ids SGLang's allocator hands out, in the process that owns the pool, one
token per page, eagerly; it zeroes and frees the slots of evicted positions in SGLang's ``req_to_token`` rows, so
nothing may read those rows' past positions as one token per position.

Also refused, though not the plugin's doing: a mixture-of-experts checkpoint with tied embeddings
(``tie_word_embeddings`` in ``MODEL_RULES``; ``refuse_tied_moe_head`` for ``sparse-rl train``'s preflight): SGLang
0.5.23's Qwen3-MoE and Qwen2-MoE models never tie their LM head to the embedding, so it would stay unloaded and every
log-prob would be garbage. And per request (``routed_experts_message``): the experts a compressed request's tokens
went to, which SGLang reads back through the request's row of ``req_to_token``, the row the plugin rewrites as it
compresses; a dense request's are right, so ``--enable-return-routed-experts`` itself is not refused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

from sglang_ext.config import BACKEND_NAME, CONFIG_ENV, INNER_BACKENDS, SparseKVConfig, config_from_env
from sparse_rl_megatron.models.families import FAMILY_SPECS, family_spec
from sparse_rl_megatron.utils.config_io import ConfigError

Stage = Literal["arguments", "model load"]


@dataclass(frozen=True)
class Rule:
    """One refused setting: ``found(subject, ...)`` returns the refused value (shown in the message), or None."""

    name: str
    """What the one-line message names: a ``ServerArgs`` field, a model-config fact, a model-runner fact."""
    found: Callable[..., Any]
    why: str
    """The feature, in words: ``"<name>=<value>: <why> is not supported by sparse_kv"``."""
    template: str = ""
    """A message of its own instead, with ``{value}``."""
    resolved_only: bool = False
    """Read only from the resolved arguments (a field SGLang derives)."""

    def message(self, value: Any) -> str:
        if self.template:
            return self.template.format(value=value)
        return f"{self.name}={value}: {self.why} is not supported by {BACKEND_NAME}"


def _flag(name: str, refused: Callable[[Any], bool], why: str) -> Rule:
    """A rule on one server flag: refused when ``refused(value)``."""
    def found(cfg: Any, config: SparseKVConfig) -> Any:
        value = getattr(cfg, name, None)
        return value if refused(value) else None

    return Rule(name, found, why)


def _on(value: Any) -> bool:
    return bool(value)


def _wider_than_one(value: Any) -> bool:
    return value is not None and int(value) > 1


def _set(value: Any) -> bool:
    return value not in (None, "", "none", "null", "auto")


def _page_size(cfg: Any, config: SparseKVConfig) -> Any:
    value = getattr(cfg, "page_size", None)
    return value if value not in (None, 1) else None


def _kv_dtype(cfg: Any, config: SparseKVConfig) -> Any:
    value = getattr(cfg, "kv_cache_dtype", None)
    return value if value not in (None, "auto") else None


def _digest_tp(cfg: Any, config: SparseKVConfig) -> Any:
    tp = getattr(cfg, "tp_size", None) or 1
    return tp if config.kept_digest and tp > 1 else None


def _graphs(cfg: Any, config: SparseKVConfig) -> Any:
    """Both phases' resolved graph backends must be ``disabled``. SGLang resolves ``cuda_graph_config`` from the JSON
    config, the per-phase flags and the legacy ``disable_cuda_graph``, in that precedence: the legacy flag alone
    proves nothing (``--cuda-graph-backend-decode full`` wins over it)."""
    graphs = getattr(cfg, "cuda_graph_config", None)
    if graphs is None:   # not resolved (a published context without the field): the legacy flag
        return None if getattr(cfg, "disable_cuda_graph", False) else ""
    if all(getattr(graphs, phase).backend == "disabled" for phase in ("decode", "prefill")):
        return None
    return f"; resolved: decode {graphs.decode.backend}, prefill {graphs.prefill.backend}"


ARGUMENT_RULES: list[Rule] = [
    _flag("attn_dp_size", _wider_than_one, "attention data parallelism (batches padded and gathered across DP ranks)"),
    _flag("enable_dp_attention", _on, "attention data parallelism (--attn-dp-size)"),
    _flag("dcp_size", _wider_than_one, "decode context parallelism (each rank reads a share of every row's KV)"),
    _flag("attn_cp_size", _wider_than_one, "attention context parallelism (rows split across ranks)"),
    _flag("enable_prefill_cp", _on, "prefill context parallelism (rows split across ranks)"),
    _flag("enable_unified_memory", _on, "unified memory (virtual KV ids, which the plugin's physical table bypasses)"),
    _flag("enable_two_batch_overlap", _on, "two-batch overlap (one attention backend per micro-batch)"),
    _flag("enable_pdmux", _on, "PD multiplexing (one attention backend per SM group)"),
    _flag("moe_a2a_backend", _set, "an MoE all-to-all backend (batches padded for MLP sync)"),
    _flag("moe_dense_tp_size", lambda v: v is not None, "a separate MoE dense TP size (batches padded for MLP sync)"),
    _flag("pp_size", _wider_than_one, "pipeline parallelism"),
    _flag("speculative_algorithm", _set, "speculative decoding (a draft model with attention backends of its own)"),
    _flag("enable_mixed_chunk", _on, "mixed prefill/decode chunks"),
    _flag("enable_hierarchical_cache", _on, "the hierarchical KV cache (host copies of pool slots)"),
    _flag("enable_lmcache", _on, "LMCache (an external KV tier that stores and reloads pool slots)"),
    _flag("enable_flexkv", _on, "FlexKV (an external KV tier, CPU / SSD / remote, that stores and reloads pool slots)"),
    _flag("enable_unified_cache_external_linker", _on,
          "the unified cache's external KV store (the linker stores and reloads pool slots)"),
    _flag("radix_cache_backend", lambda v: v is not None,
          "a registered radix-cache backend (FlexKV's or another's cache in place of SGLang's radix tree, whose "
          "prefix reuse the plugin hooks)"),
    _flag("enable_hisparse", _on, "hierarchical sparse attention"),
    _flag("disaggregation_mode", _set, "prefill/decode disaggregation (KV transferred by slot)"),
    _flag("enable_streaming_session", _on,
          "streaming sessions (a finished request's row is lent to the session's next turn as it stands, and freed "
          "at release_session: a compressed row's zeroed and reused entries would be read as its KV and freed)"),
    _flag("enable_return_indexer_topk", _on,
          "returning indexer top-k (read from req_to_token at finish, whose entries a compressed request has "
          "zeroed or reused)"),
    _flag("enable_torch_compile", _on,
          "torch.compile (SGLang compiles the captured decode graph: CPU graphs on CPU, CUDA graphs on GPU; the "
          "plugin runs its bookkeeping eagerly)"),
    Rule("page_size", _page_size, "pages of more than one token",
         template=f"page_size={{value}}: {BACKEND_NAME} needs page_size 1 (a page would mix kept and evicted tokens)"),
    Rule("kv_cache_dtype", _kv_dtype, "a KV cache dtype other than the model's",
         template=f"kv_cache_dtype={{value}}: {BACKEND_NAME} needs the model dtype (auto) for the KV cache"),
    Rule("kept_digest", _digest_tp, "kept digests with TP > 1",
         template="kept_digest needs tp_size 1 (each TP rank holds only its KV heads); got tp_size={value}"),
    Rule("cuda_graph_config", _graphs, "CUDA graphs", resolved_only=True,
         template=f"{BACKEND_NAME} runs its bookkeeping and compaction eagerly and does not support CUDA graphs "
                  "(breakable ones included{value}): pass disable_cuda_graph=True and no per-phase graph backend or "
                  "cuda_graph_config (CLI: --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill "
                  "disabled)"),
]
"""The server flags refused, in the order they are checked."""


def _ssm_state(model_config: Any) -> Any:
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state

    return model_config.hf_config.architectures[0] if uses_ssm_state(model_config) else None


def _attention_arch(model_config: Any) -> Any:
    from sglang.srt.configs.model_config import AttentionArch

    arch = model_config.attention_arch
    return arch.name if arch != AttentionArch.MHA else None


TIED_MOE_HEAD = ("tie_word_embeddings=true: SGLang 0.5.23's {value} model never ties its LM head to the embedding (it "
                 "would stay unloaded); valid for a mixture of experts: untied checkpoints (every published Qwen MoE), "
                 "or the hf rollout engine")


def tied_moe_head(hf_config: dict[str, Any]) -> str | None:
    """The model type of a config with tied embeddings whose SGLang 0.5.23 model never ties its LM head (a Qwen MoE:
    ``FamilySpec.sglang_ties_head`` false; refused), else None."""
    model_type = hf_config.get("model_type")
    untied = model_type in FAMILY_SPECS and not family_spec(model_type).sglang_ties_head
    return model_type if untied and hf_config.get("tie_word_embeddings") else None


def refuse_tied_moe_head(hf_config: dict[str, Any]) -> None:
    """ConfigError (one line) for a Qwen MoE config dict with tied embeddings (``sparse-rl train``'s preflight)."""
    model_type = tied_moe_head(hf_config)
    if model_type is not None:
        raise ConfigError(TIED_MOE_HEAD.format(value=model_type))


MODEL_RULES: list[Rule] = [
    Rule("attention_arch", _attention_arch, "MLA or state-space attention (per-head K/V slots are needed)"),
    Rule("is_hybrid_swa", lambda mc: True if mc.is_hybrid_swa else None,
         "a hybrid sliding-window model (its window layers keep a KV pool of their own, SWAKVPool)"),
    Rule("ssm_state", _ssm_state,
         "a hybrid linear-attention / state-space model (recurrent state beside the KV pool, HybridLinearKVPool)"),
    Rule("attention_chunk_size", lambda mc: mc.attention_chunk_size,
         "chunked local attention (a window over the logical positions the plugin's table no longer lists)"),
    Rule("is_encoder_decoder", lambda mc: True if mc.is_encoder_decoder else None, "cross-attention (encoder-decoder)"),
    Rule("tie_word_embeddings", lambda mc: tied_moe_head(mc.hf_config.to_dict()), "a tied LM head of a Qwen MoE",
         template=TIED_MOE_HEAD),
]
"""Facts of the model's config refused when the arguments are resolved (``ModelConfig``, before the model loads)."""


def _pool(runner: Any) -> Any:
    """The pool's class unless it is exactly ``MHATokenToKVPool``: its subclasses keep other layouts (FP4 and MXFP8
    packed data with scale buffers, page-major, unified, no-op), which an ``isinstance`` check let through."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = runner.token_to_kv_pool
    return None if type(pool) is MHATokenToKVPool else type(pool).__name__


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _pool_dtype(runner: Any) -> Any:
    """The KV pool's dtype as SGLang resolved it, when it is not the model's: ``--kv-cache-dtype auto`` becomes FP8
    when the checkpoint's quantization config sets ``kv_cache_quant_algo`` FP8 (``kv_cache_dtype.py``), which a
    check of the flag never sees."""
    dtype = runner.token_to_kv_pool.dtype
    if dtype == runner.dtype:
        return None
    algo = getattr(getattr(runner.model, "quant_config", None), "kv_cache_quant_algo", None)
    cause = f", from the checkpoint's quantization config: kv_cache_quant_algo={algo}" if algo else ""
    return f"{_dtype_name(dtype)} (model dtype {_dtype_name(runner.dtype)}{cause})"


def _window_layers(runner: Any) -> Any:
    if runner.sliding_window_size is not None:
        return runner.sliding_window_size
    windows = sorted({layer.sliding_window_size for layer in _attention_layers(runner)
                      if layer.sliding_window_size is not None and layer.sliding_window_size > -1})
    return windows[0] if windows else None


def _cross_attention(runner: Any) -> Any:
    layers = [layer.layer_id for layer in _attention_layers(runner) if layer.is_cross_attention]
    return f"layer {layers[0]}" if layers else None


def _attention_layers(runner: Any) -> list:
    from sglang.srt.layers.radix_attention import RadixAttention

    return [m for m in runner.model.modules() if isinstance(m, RadixAttention)]


RUNNER_RULES: list[Rule] = [
    Rule("use_mla_backend", lambda r: True if r.use_mla_backend else None, "MLA (per-head K/V slots are needed)"),
    Rule("token_to_kv_pool", _pool,
         "a KV pool other than SGLang's per-head MHATokenToKVPool itself (its subclasses included: the quantised "
         "FP4 / MXFP8 pools of --kv-cache-dtype nvfp4 / mxfp8, like sliding-window, hybrid linear-attention, MLA or "
         "page-major pools, keep other slot layouts)"),
    Rule("kv_cache_dtype", _pool_dtype, "a quantised KV cache",
         template=f"kv_cache_dtype resolved to {{value}}: {BACKEND_NAME} needs the KV cache in the model's dtype (its "
                  "scorers and compaction read and write the stored keys and values as they are, without their "
                  "quantization scales); serve a checkpoint without KV-cache quantization (no kv_cache_quant_algo in "
                  "its quantization config) with --kv-cache-dtype auto"),
    Rule("sliding_window_size", _window_layers,
         "sliding-window attention (the window is over logical positions the plugin's table no longer lists)"),
    Rule("is_cross_attention", _cross_attention, "cross-attention"),
]
"""Facts of the loaded model and its KV pool refused when the backend is built (checked in this order)."""
ELSEWHERE_AT_MODEL_LOAD = {
    "kv_index_translator": "runner_view.physical_translator: a KV pool that translates its ids",
    "second_backend": "backend._claim_process: a second sparse_kv backend in one process",
}
"""Model-load refusals checked where the backend builds what they concern."""


OTHER_BACKEND = "attention_backend"
"""What the README lists for an attention backend other than ``sparse_kv`` beside a sparse_kv config
(``refuse_other_backend``; any of ``BACKEND_FLAGS``)."""
BACKEND_FLAGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
"""SGLang 0.5.23's attention-backend fields: the base one and the per-phase ones that win over it."""


def refusals() -> dict[Stage, set[str]]:
    """Every name refused, per stage (what ``sglang_ext/README.md`` must list)."""
    return {"arguments": {r.name for r in (*ARGUMENT_RULES, *MODEL_RULES)} | {OTHER_BACKEND},
            "model load": {r.name for r in RUNNER_RULES} | set(ELSEWHERE_AT_MODEL_LOAD)}


def _backends(args: Any, resolved: bool) -> tuple[Any, Any]:
    if resolved:
        from sglang.srt.arg_groups.overrides import attention_backends_of, resolved_view

        return attention_backends_of(resolved_view(args))
    backend = getattr(args, "attention_backend", None)
    return (getattr(args, "prefill_attention_backend", None) or backend,
            getattr(args, "decode_attention_backend", None) or backend)


def asks_for_sparse_kv(args: Any) -> bool:
    """A sparse_kv config is given (``SPARSE_RL_KV_CONFIG`` set, as ``--sparse-kv-config`` sets it) or an
    attention-backend field names ``sparse_kv``: everything but ``sparse_kv`` in ``BACKEND_FLAGS`` is refused."""
    return bool(os.environ.get(CONFIG_ENV, "").strip()) or any(
        getattr(args, flag, None) == BACKEND_NAME for flag in BACKEND_FLAGS)


def other_backend_message(flag: str, value: Any, resolved: bool = False) -> str:
    """One line: ``flag`` (one of ``BACKEND_FLAGS``) is ``value``, not sparse_kv, beside a sparse_kv config."""
    cli = "--" + flag.replace("_", "-")
    if value is None:
        fix = f"pass {cli} {BACKEND_NAME} (sglang_ext.launch_server adds it)"
    elif value in INNER_BACKENDS:
        fix = (f"pass {cli} {BACKEND_NAME} (or leave it out) and put \"{value}\" in the config's inner_backend, which "
               "runs the kernels under the plugin")
    else:
        fix = (f"pass {cli} {BACKEND_NAME} and pick the kernels with the config's inner_backend (one of "
               f"{', '.join(INNER_BACKENDS)}, or '' for the device's default)")
    how = " (resolved)" if resolved else ""
    return (f"{flag}={value}{how}: a sparse_kv config (--sparse-kv-config / {CONFIG_ENV}) is served by the "
            f"{BACKEND_NAME} attention backend only, in both phases (SGLang would run {value} without the plugin and "
            f"ignore the config); {fix}")


def refuse_other_backend(args: Any, *, resolved: bool) -> None:
    """Raise ConfigError (one line) for an attention backend other than sparse_kv: as given, every field of
    ``BACKEND_FLAGS`` that is set (and at least one must be: SGLang's default is not sparse_kv); resolved, both
    phases."""
    if resolved:
        for flag, value in zip(("prefill_attention_backend", "decode_attention_backend"), _backends(args, True)):
            if value != BACKEND_NAME:
                raise ConfigError(other_backend_message(flag, value, resolved=True))
        return
    given = {flag: getattr(args, flag, None) for flag in BACKEND_FLAGS}
    for flag, value in given.items():
        if value is not None and value != BACKEND_NAME:
            raise ConfigError(other_backend_message(flag, value))
    if all(value is None for value in given.values()):
        raise ConfigError(other_backend_message(OTHER_BACKEND, None))


def uses_sparse_kv(args: Any, *, resolved: bool = True) -> bool:
    return BACKEND_NAME in _backends(args, resolved)


def refuse_flags(cfg: Any, config: SparseKVConfig, *, resolved: bool = True) -> None:
    """Raise ConfigError (one line) for the first refused flag of ``cfg`` (raw ServerArgs or a resolved view)."""
    for rule in ARGUMENT_RULES:
        if rule.resolved_only and not resolved:
            continue
        value = rule.found(cfg, config)
        if value is not None:
            raise ConfigError(rule.message(value))


def refuse_model(model_config: Any) -> None:
    """Raise ConfigError (one line) for the first refused fact of the model's config (``MODEL_RULES``)."""
    for rule in MODEL_RULES:
        value = rule.found(model_config)
        if value is not None:
            raise ConfigError(f"model {model_config.model_path}: {rule.message(value)}")


def refuse_at_model_load(model_runner: Any) -> None:
    """``SparseKVBackend.__init__``, first: raise ConfigError (one line) for the first refused fact of the loaded
    model and its KV pool (``RUNNER_RULES``), before the backend reads the pool."""
    for rule in RUNNER_RULES:
        value = rule.found(model_runner)
        if value is not None:
            raise ConfigError(f"{BACKEND_NAME} at model load: {rule.message(value)}")


def _raw_model_config(server_args: Any):
    """The model's config as SGLang will read it, from the arguments as given (not memoized on them: SGLang's own
    resolution builds its own), or None when SGLang cannot read it yet (its resolution reports why)."""
    from sglang.srt.configs.model_config import ModelConfig

    try:
        return ModelConfig.from_server_args(server_args)
    except Exception:  # noqa: BLE001 - a bad model path or config is SGLang's to report, in its own words
        return None


def refuse_before_resolution(server_args: Any) -> None:
    """``ServerArgs.resolve_once`` BEFORE hook: the raw flags and the model's config, before SGLang rewrites or
    rejects them."""
    if not asks_for_sparse_kv(server_args):
        return None
    refuse_other_backend(server_args, resolved=False)   # first: before the model's config is read
    refuse_flags(server_args, config_from_env(), resolved=False)
    model_config = _raw_model_config(server_args)
    if model_config is not None:
        refuse_model(model_config)
    return None


def validate_server_args(server_args: Any, config: SparseKVConfig | None = None) -> SparseKVConfig:
    """``ServerArgs.check_server_args`` AFTER hook: the resolved settings. Returns the config."""
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.arg_groups.overrides import resolved_view

    cfg = resolved_view(server_args)
    config = config if config is not None else config_from_env()
    refuse_flags(cfg, config)
    refuse_model(model_config_of(server_args))
    return config


def routed_experts_message() -> str:
    """Why a compressed request asking for its routed experts is refused (it is aborted; the others are served)."""
    return (f"return_routed_experts: SGLang reads a request's routed experts back through its req_to_token row, which "
            f"{BACKEND_NAME} rewrites as it compresses (evicted slots are freed and reused), so a compressed "
            "request's would name other tokens' experts; ask it of dense requests (compression method none) only")


def refused_beam_message(beam_width: Any) -> str:
    """Why a beam-search request is refused (it is aborted; the server keeps serving the others)."""
    return (f"beam_width={beam_width}: beam search is not supported by {BACKEND_NAME} (beam rows share prompt slots "
            "and are remapped every step, which the plugin's per-request table does not follow); sample n "
            "sequences instead")
