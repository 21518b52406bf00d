"""The SGLang settings the ``sparse_kv`` backend refuses, each in one line naming the flag, when the server starts.

Checked twice, on the same rules:

- before SGLang resolves its arguments (``ServerArgs.resolve_once``, on the fields as given): SGLang's own
  resolution rewrites some of them (``--enable-dp-attention`` becomes ``attn_dp_size`` and is cleared) or
  rejects them first with a message about something else (unified memory, PD multiplexing, two-batch overlap);
- after ``ServerArgs.check_server_args``, on the resolved values (what the scheduler will run with).

Why each is refused: the plugin keeps one physical table per request row and one attention backend per
process; it reads and writes the KV pool by the slot ids SGLang's allocator hands out, in the process that
owns the pool, one token per page, eagerly.

Also refused, though not the plugin's doing: a mixture-of-experts checkpoint with tied embeddings
(``refuse_model``): SGLang 0.5.23's Qwen3-MoE and Qwen2-MoE models never tie their LM head to the embedding, so
it would stay unloaded and every log-prob would be garbage. And per request (``routed_experts_message``): the
experts a compressed request's tokens went to, which SGLang reads back through the request's row of
``req_to_token``, the row the plugin rewrites as it compresses.
"""
from __future__ import annotations

from typing import Any, Callable

from sglang_ext.config import BACKEND_NAME, SparseKVConfig, config_from_env
from sparse_rl_megatron.utils.config_io import ConfigError


def _on(value: Any) -> bool:
    return bool(value)


def _wider_than_one(value: Any) -> bool:
    return value is not None and int(value) > 1


def _set(value: Any) -> bool:
    return value not in (None, "", "none", "null", "auto")


# (field, is_refused(value), why): the message is "<field>=<value>: <why>; not supported by sparse_kv"
FLAG_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("attn_dp_size", _wider_than_one, "attention data parallelism (batches padded and gathered across DP ranks)"),
    ("enable_dp_attention", _on, "attention data parallelism (--attn-dp-size)"),
    ("dcp_size", _wider_than_one, "decode context parallelism (each rank reads a share of every row's KV)"),
    ("attn_cp_size", _wider_than_one, "attention context parallelism (rows split across ranks)"),
    ("enable_prefill_cp", _on, "prefill context parallelism (rows split across ranks)"),
    ("enable_unified_memory", _on, "unified memory (virtual KV ids, which the plugin's physical table bypasses)"),
    ("enable_two_batch_overlap", _on, "two-batch overlap (one attention backend per micro-batch)"),
    ("enable_pdmux", _on, "PD multiplexing (one attention backend per SM group)"),
    ("moe_a2a_backend", _set, "an MoE all-to-all backend (batches padded for MLP sync)"),
    ("moe_dense_tp_size", lambda v: v is not None, "a separate MoE dense TP size (batches padded for MLP sync)"),
    ("pp_size", _wider_than_one, "pipeline parallelism"),
    ("speculative_algorithm", _set, "speculative decoding (a draft model with attention backends of its own)"),
    ("enable_mixed_chunk", _on, "mixed prefill/decode chunks"),
    ("enable_hierarchical_cache", _on, "the hierarchical KV cache (host copies of pool slots)"),
    ("enable_hisparse", _on, "hierarchical sparse attention"),
    ("disaggregation_mode", _set, "prefill/decode disaggregation (KV transferred by slot)"),
]


def _backends(args: Any, resolved: bool) -> tuple[Any, Any]:
    if resolved:
        from sglang.srt.arg_groups.overrides import attention_backends_of, resolved_view

        return attention_backends_of(resolved_view(args))
    backend = getattr(args, "attention_backend", None)
    return (getattr(args, "prefill_attention_backend", None) or backend,
            getattr(args, "decode_attention_backend", None) or backend)


def uses_sparse_kv(args: Any, *, resolved: bool = True) -> bool:
    return BACKEND_NAME in _backends(args, resolved)


def refuse_flags(cfg: Any, config: SparseKVConfig) -> None:
    """Raise ConfigError (one line) for the first refused setting of ``cfg`` (raw ServerArgs or a resolved view)."""
    for name, refused, why in FLAG_RULES:
        value = getattr(cfg, name, None)
        if refused(value):
            raise ConfigError(f"{name}={value}: {why} is not supported by {BACKEND_NAME}")
    page_size = getattr(cfg, "page_size", None)
    if page_size not in (None, 1):
        raise ConfigError(f"page_size={page_size}: {BACKEND_NAME} needs page_size 1 (a page would mix kept and "
                          "evicted tokens)")
    kv_dtype = getattr(cfg, "kv_cache_dtype", None)
    if kv_dtype not in (None, "auto"):
        raise ConfigError(f"kv_cache_dtype={kv_dtype}: {BACKEND_NAME} needs the model dtype (auto) for the KV cache")
    tp = getattr(cfg, "tp_size", None) or 1
    if config.kept_digest and tp > 1:
        raise ConfigError(f"kept_digest needs tp_size 1 (each TP rank holds only its KV heads); got tp_size={tp}")


def refuse_before_resolution(server_args: Any) -> None:
    """``ServerArgs.resolve_once`` BEFORE hook: the raw flags, before SGLang rewrites or rejects them."""
    if not uses_sparse_kv(server_args, resolved=False):
        return None
    refuse_flags(server_args, config_from_env())
    return None


def validate_server_args(server_args: Any, config: SparseKVConfig | None = None) -> SparseKVConfig:
    """``ServerArgs.check_server_args`` AFTER hook: the resolved settings. Returns the config."""
    from sglang.srt.arg_groups.overrides import resolved_view

    cfg = resolved_view(server_args)
    config = config if config is not None else config_from_env()
    prefill, decode = _backends(server_args, resolved=True)
    if prefill != decode:
        raise ConfigError(f"{BACKEND_NAME}: prefill and decode must both use the {BACKEND_NAME} attention "
                          f"backend (got prefill={prefill}, decode={decode}); set attention_backend only")
    refuse_flags(cfg, config)
    refuse_model_dir(str(getattr(cfg, "model_path", "") or ""))
    if not _graphs_disabled(cfg):
        graphs = getattr(cfg, "cuda_graph_config", None)
        resolved = ("" if graphs is None else
                    f"; resolved: decode {graphs.decode.backend}, prefill {graphs.prefill.backend}")
        raise ConfigError(f"{BACKEND_NAME} runs its bookkeeping and compaction eagerly and does not support CUDA "
                          f"graphs (breakable ones included{resolved}): pass disable_cuda_graph=True and no "
                          "per-phase graph backend or cuda_graph_config (CLI: --cuda-graph-backend-decode disabled "
                          "--cuda-graph-backend-prefill disabled)")
    return config


def _graphs_disabled(cfg: Any) -> bool:
    """Both phases' resolved graph backends are ``disabled``. SGLang resolves ``cuda_graph_config`` from the JSON
    config, the per-phase flags and the legacy ``disable_cuda_graph``, in that precedence: the legacy flag alone
    proves nothing (``--cuda-graph-backend-decode full`` wins over it)."""
    graphs = getattr(cfg, "cuda_graph_config", None)
    if graphs is None:   # not resolved (a published context without the field): the legacy flag
        return bool(getattr(cfg, "disable_cuda_graph", False))
    return all(getattr(graphs, phase).backend == "disabled" for phase in ("decode", "prefill"))


UNTIED_HEAD_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
"""Model types whose SGLang 0.5.23 implementation ignores ``tie_word_embeddings`` (no tied LM head)."""


def refuse_model(hf_config: dict[str, Any]) -> None:
    """Raise ConfigError (one line) for a model SGLang would serve wrongly: a Qwen MoE with tied embeddings."""
    model_type = hf_config.get("model_type")
    if model_type in UNTIED_HEAD_MODEL_TYPES and hf_config.get("tie_word_embeddings"):
        raise ConfigError(f"tie_word_embeddings=true: SGLang 0.5.23's {model_type} model never ties its LM head to the "
                          "embedding (it would stay unloaded); valid for a mixture of experts: untied checkpoints "
                          "(every published Qwen MoE), or the hf rollout engine")


def refuse_model_dir(model_path: str) -> None:
    """``refuse_model`` on a local HF directory's ``config.json`` (a hub id or a directory without one: nothing to
    check here; SGLang reads it itself)."""
    import json
    from pathlib import Path

    config = Path(model_path) / "config.json"
    if config.is_file():
        refuse_model(json.loads(config.read_text()))


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
