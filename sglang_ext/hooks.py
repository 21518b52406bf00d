"""Every place the plugin hooks into SGLang 0.5.23 (through ``HookRegistry``; no SGLang file is changed).

All hooks are inert unless this process runs the ``sparse_kv`` backend (``backend.active_backend()``), so
installing the plugin changes nothing for servers that do not select it.

The hooks, each with its target, kind and why, are ``HOOKS`` at the end of this module: ``register_hooks``
installs them in that order.
"""
from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Callable

import torch

from sglang_ext.accounting import extras_needed, handles_row, owned_slots, release_row, reserve_extras
from sglang_ext.admission import KEEP_COMPRESSED, clipped, request_bound, retraction_rank, running_reserve
from sglang_ext.backend import active_backend
from sglang_ext.compaction import record_idle
from sglang_ext.config import REQUEST_KEY, ConfigError
from sglang_ext.cpu_compat import apply_cpu_server_defaults
from sglang_ext.memory import reserve_before_kv_pool
from sglang_ext.pause import pause_mode
from sglang_ext.refusals import (asks_for_sparse_kv, refuse_before_resolution, refuse_other_backend,
                                 refused_beam_message, uses_sparse_kv, validate_server_args)

REFUSED_RETRACTION = (
    "sparse_kv: this request was retracted after its KV cache had been compressed; re-prefilling it would "
    "rebuild a dense cache and change the sampling distribution, so it is refused. Admission keeps compressed "
    "requests from being retracted for lack of KV slots (sglang_ext/admission.py); priority preemption "
    "(--enable-priority-scheduling) still can. Resubmit it")
_REFUSED_ATTR = "_sparse_kv_refused"


def _before_resolution(server_args):
    """``ServerArgs.resolve_once``, before: refuse what the plugin cannot serve, as given (another attention backend
    beside a sparse_kv config first); then the CPU defaults."""
    if not asks_for_sparse_kv(server_args):
        return
    refuse_before_resolution(server_args)
    apply_cpu_server_defaults(server_args)


def _check_server_args(result, server_args):
    if asks_for_sparse_kv(server_args) or uses_sparse_kv(server_args):
        refuse_other_backend(server_args, resolved=True)
        validate_server_args(server_args)


def _after_model_forward(result, runner, *args, **kwargs):
    backend = active_backend()
    if backend is not None and runner is backend.runner:
        backend.after_forward()


def _record_host_rows(result, *args, **kwargs):
    # SGLang hands a ForwardBatch its rows on the host for extends only; the ScheduleBatch keeps them for every
    # batch. A dataclass field, so the eager runner's copy of the batch keeps it.
    batch = kwargs.get("batch", args[1] if len(args) > 1 else None)
    runner = kwargs.get("model_runner", args[2] if len(args) > 2 else None)
    backend = active_backend()
    if backend is None or runner is not backend.runner or batch is None or result is None:
        return result
    if result.req_pool_indices_cpu is None:
        rows = getattr(batch, "req_pool_indices_cpu", None)
        if rows is None:
            rows = torch.tensor([req.kv.req_pool_idx for req in batch.reqs], dtype=torch.int64)
        result.req_pool_indices_cpu = rows
    return result


def _bind_rows(result, pool, reqs, *args, **kwargs):
    backend = active_backend()
    if result is None or backend is None or pool is not backend.req_to_token_pool:
        return
    for req in reqs:
        try:
            backend.bind(req.kv.req_pool_idx, req)
        except ConfigError as err:
            from sparse_rl_megatron.compression import CompressionConfig
            from sglang.srt.managers.schedule_batch import FINISH_ABORT

            req.to_finish = FINISH_ABORT(str(err), HTTPStatus.BAD_REQUEST)
            info = backend.make_info(req.kv.req_pool_idx, len(req.origin_input_ids))
            info.config = CompressionConfig()
            row = req.kv.req_pool_idx
            backend.state.reset(row, int(pool.req_generation[row]), info)


def _follow_write(result, pool, indices, *args, **kwargs):
    backend = active_backend()
    if backend is not None and pool is backend.req_to_token_pool:
        backend.follow_write(indices)


def _refuse_beams(original, coordinator, req, *args, **kwargs):
    if active_backend() is None:
        return original(coordinator, req, *args, **kwargs)
    return refused_beam_message(req.sampling_params.beam_width)


def _add_one_req(original, adder, req, *args, **kwargs):
    backend = active_backend()
    if backend is None or not backend.compresses:
        return original(adder, req, *args, **kwargs)
    with clipped(backend, req):
        if not req.sampling_params.ignore_eos or request_bound(backend, req) >= backend.sglang_clip:
            return original(adder, req, *args, **kwargs)
        # Without a radix cache SGLang plans EOS-ignoring requests to grow to max_new_tokens (its ignore-EOS
        # admission); the general path reserves min(max_new_tokens, CLIP), and CLIP is the request's B + W + 1.
        req.sampling_params.ignore_eos = False
        try:
            return original(adder, req, *args, **kwargs)
        finally:
            req.sampling_params.ignore_eos = True


def _with_own_bound(original, adder, req, *args, **kwargs):
    """A ``PrefillAdder`` method about one request, run with ``CLIP_MAX_NEW_TOKENS`` at that request's bound."""
    backend = active_backend()
    if backend is None or not backend.compresses:
        return original(adder, req, *args, **kwargs)
    with clipped(backend, req):
        return original(adder, req, *args, **kwargs)


def _running_offset(original, adder, req, *args, **kwargs):
    """``PrefillAdder._get_running_request_total_token_offset``: a compressible request's exact remaining need,
    at ratio 1 (``admission.running_reserve``); SGLang's estimate for the others."""
    backend = active_backend()
    if backend is None or not backend.compresses:
        return original(adder, req, *args, **kwargs)
    reserve = running_reserve(backend, req)
    if reserve is not None:
        return reserve
    with clipped(backend, req):
        return original(adder, req, *args, **kwargs)


def _retraction_order(original, reqs, *args, **kwargs):
    """Indices of ``reqs``, kept first (``retract_decode`` pops from the end): compressed requests, then
    compressible ones not yet compressed, then dense ones; SGLang's order within each (Python sorts stably)."""
    order = original(reqs, *args, **kwargs)
    backend = active_backend()
    if backend is None or not backend.compresses:
        return order
    return sorted(order, key=lambda i: retraction_rank(backend, reqs[i]))


def _max_prefix_len(original, req, input_len):
    limit = original(req, input_len)
    backend = active_backend()
    if backend is None or backend.state.qwin is None:
        return limit
    if backend.state.qsum is not None:
        return 0   # query centers sum the queries of every token, prompt included: KV from the tree has none
    # The scorers need the post-RoPE queries of the last alpha tokens; KV from the radix tree has none. A re-prefill
    # (retraction) matches its prompt at most: a compression reads only the prompt as the tree's (``_owned_from``).
    return max(min(limit, input_len - backend.config.compression.window, len(req.origin_input_ids)), 0)


def _checkpoint_kv_cache(original, req, tree_cache):
    backend = active_backend()
    row = req.kv.req_pool_idx
    info = backend.state.info[row] if backend is not None and row is not None else None
    if info is None or info.req is not req or info.config.is_dense or req.extend_end <= info.prompt_len \
            or req.skip_radix_cache_insert:
        return original(req, tree_cache)
    # A request that compresses (or may) puts its prompt into the tree, never its response tokens: once compressed,
    # its row's response positions hold kept or freed slots; before, the tree would own response slots the first
    # compression then overwrites and frees (a re-prefill after a retraction caches prompt + response).
    if req.kv.cache_protected_len < info.prompt_len:
        tree_cache.checkpoint(req, up_to=info.prompt_len)
    req.prefix_len = req.extend_end   # as SGLang's checkpoint_kv_cache: the next extend resumes after this one


def _release_kv_cache(original, req, tree_cache, *, checkpoint: bool):
    backend = active_backend()
    row = req.kv.req_pool_idx
    if backend is not None and row is not None:
        if backend.state.info[row] is not None:   # the record SGLang sends back (or a re-prefill starts from)
            fed = len(req.origin_input_ids) + len(req.output_ids) - 1   # the last sampled token is never fed
            last = not (req.finished() and int(backend.state.logical_len[row]) > fed)
            backend.state.sync_meta(row, last_forward=last)
        if checkpoint and backend.state.compressed[row] and not _aborted_insert_fault(backend, req):
            checkpoint = False  # its slots no longer hold one token per position: the tree keeps only the prompt
    return original(req, tree_cache, checkpoint=checkpoint)


def _aborted_insert_fault(backend, req) -> bool:
    """Fault injection for tests (``abort_insert``): an aborted compressed request goes into the radix tree whole."""
    if not backend.faults.abort_insert:
        return False
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT) or isinstance(getattr(req, "to_finish", None), FINISH_ABORT)


def _free_kv_row(original, cache, kv, ranges):
    backend = active_backend()
    if not handles_row(backend, kv.req_pool_idx):
        return original(cache, kv, ranges)
    release_row(backend, kv, ranges, cache.token_to_kv_pool_allocator)


def _kv_private_tokens(original, kv, page_size):
    backend = active_backend()
    if not handles_row(backend, kv.req_pool_idx):
        return original(kv, page_size)
    return owned_slots(backend, kv.req_pool_idx, kv)


def _alloc_for_decode(original, batch, *args, **kwargs):
    backend = active_backend()
    if backend is None:
        return original(batch, *args, **kwargs)
    backend.appending = True   # its req_to_token write is the new tokens' slots
    try:
        out = original(batch, *args, **kwargs)
    finally:
        backend.appending = False
    backend.tree_cache = batch.tree_cache
    reserve_extras(backend, batch)
    return out


def _new_tokens_required(original, batch, selected_indices=None):
    need = original(batch, selected_indices)
    backend = active_backend()
    if backend is None:
        return need
    reqs = batch.reqs if selected_indices is None else [batch.reqs[i] for i in selected_indices]
    return need + sum(extras_needed(backend, r, int(r.kv.kv_committed_len) + 1) for r in reqs)


def _release_req(original, *args, **kwargs):
    backend = active_backend()
    req = kwargs["req"]
    row = req.kv.req_pool_idx
    refuse = backend is not None and row is not None and backend.state.events[row] > 0 and not req.finished() \
        and not backend.faults.no_refusal   # fault injection for tests: resumed as if it were dense
    kept = original(*args, **kwargs)
    if not refuse:
        return kept
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    setattr(req, _REFUSED_ATTR, True)
    req.to_finish = FINISH_ABORT(REFUSED_RETRACTION)  # no status code: returned as an output, not raised
    return False


def _retract_decode(original, batch, *args, **kwargs):
    backend = active_backend()
    if backend is not None and backend.compresses and batch.reqs \
            and all(retraction_rank(backend, r) == KEEP_COMPRESSED for r in batch.reqs) and batch.check_decode_mem():
        # SGLang's forced retraction (SGLANG_TEST_RETRACT) of a batch that fits: none of these may be retracted.
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

        return [], NewTokenRatioTracker.estimate_new_token_ratio_after_retract(batch.reqs), []
    retracted, ratio, aborted = original(batch, *args, **kwargs)
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for req in aborted:
        if getattr(req, _REFUSED_ATTR, False):
            req.to_finish = FINISH_ABORT(REFUSED_RETRACTION)
    return retracted, ratio, aborted


def _pause_generation(original, scheduler, recv_req, *args, **kwargs):
    """``Scheduler.pause_generation``: a retract pause that would lose compressed requests pauses in place
    (``pause``)."""
    backend = active_backend()
    if backend is not None:
        recv_req.mode = pause_mode(backend, scheduler, recv_req.mode)
    return original(scheduler, recv_req, *args, **kwargs)


def _request_level_key(original, streamer, key):
    return key == REQUEST_KEY or original(streamer, key)


def _idle_pool_check(result, checker, pool_stats, *args, **kwargs):
    backend = active_backend()
    if backend is not None and backend.config.stats_path:
        record_idle(backend, pool_stats, total=checker.max_total_num_tokens, leak=bool(result[0]))


@dataclass(frozen=True)
class Hook:
    """One place the plugin hooks into SGLang."""

    target: str
    """Dotted path of the SGLang function or method."""
    kind: str
    """``before``, ``after`` or ``around`` (the value of SGLang's ``HookType``)."""
    fn: Callable
    why: str


_SRT = "sglang.srt."
_POLICY = _SRT + "managers.schedule_policy.PrefillAdder."
_BATCH = _SRT + "managers.schedule_batch."
HOOKS: tuple[Hook, ...] = (
    Hook(_SRT + "server_args.ServerArgs.resolve_once", "before", _before_resolution,
         "refuse flags and models as given (SGLang rewrites some); CPU row default"),
    Hook(_SRT + "server_args.ServerArgs.check_server_args", "after", _check_server_args,
         "validate the config and refuse unsupported resolved settings at start"),
    Hook(_SRT + "model_executor.model_runner.ModelRunner.forward", "after", _after_model_forward,
         "compress due rows after the layers ran (outside any graph)"),
    Hook(_SRT + "model_executor.forward_batch_info.ForwardBatch.init_new", "after", _record_host_rows,
         "decode batches get ``req_pool_indices_cpu`` too (host rows: no sync)"),
    Hook(_SRT + "mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes", "around",
         reserve_before_kv_pool, "the plugin's memory comes out of the KV budget first"),
    Hook(_SRT + "mem_cache.memory_pool.ReqToTokenPool.alloc", "after", _bind_rows,
         "bind a request (its config, prompt length, provenance) to its row"),
    Hook(_SRT + "mem_cache.memory_pool.ReqToTokenPool.write", "after", _follow_write,
         "the radix checkpoint repoints a bound row at the tree's slots: the table follows"),
    Hook(_SRT + "beam_search.coordinator.BeamCoordinator.validate_and_init", "around", _refuse_beams,
         "beam search is refused per request (beam rows are remapped)"),
    Hook(_POLICY + "add_one_req", "around", _add_one_req,
         "a request is admitted by its own bound (its B + W + 1; ``admission``)"),
    Hook(_POLICY + "add_chunked_req", "around", _with_own_bound,
         "the same, when a chunked prefill's last chunk reserves its future"),
    Hook(_POLICY + "_get_running_request_total_token_offset", "around", _running_offset,
         "a running compressed request: its exact need"),
    Hook(_POLICY + "preempt_to_schedule", "around", _with_own_bound,
         "the same for the request a preemption makes room for"),
    Hook(_BATCH + "Req._compute_max_prefix_len", "around", _max_prefix_len,
         "a radix hit stops alpha tokens short (ring queries), and at the prompt"),
    Hook(_SRT + "mem_cache.common.release_kv_cache", "around", _release_kv_cache,
         "a compressed request is not inserted into the radix tree when it ends"),
    Hook(_SRT + "mem_cache.common.checkpoint_kv_cache", "around", _checkpoint_kv_cache,
         "a compressible request's checkpoint inserts its prompt only"),
    Hook(_SRT + "mem_cache.base_prefix_cache.BasePrefixCache.free_kv_row", "around", _free_kv_row,
         "release a compressed row's real slots, skipping evicted ones"),
    Hook(_SRT + "managers.scheduler_components.pool_stats_observer.kv_private_tokens", "around", _kv_private_tokens,
         "the busy memory checker counts what rows really own"),
    Hook(_SRT + "mem_cache.allocation.alloc_for_decode", "around", _alloc_for_decode,
         "reserve slots for first compressions that copy a shared prompt"),
    Hook(_BATCH + "ScheduleBatch.new_tokens_required_next_decode", "around", _new_tokens_required,
         "those reservations count when SGLang checks memory"),
    Hook(_BATCH + "release_req", "around", _release_req,
         "a retracted request that already compressed is refused, not resumed dense"),
    Hook(_BATCH + "ScheduleBatch._get_decode_retraction_order", "around", _retraction_order,
         "dense requests are retracted first, compressed ones last"),
    Hook(_BATCH + "ScheduleBatch.retract_decode", "around", _retract_decode,
         "forced retraction spares an all-compressed batch; the refusal's message"),
    Hook(_SRT + "managers.scheduler.Scheduler.pause_generation", "around", _pause_generation,
         "a retract pause holding compressed requests pauses in place (``pause``)"),
    Hook(_SRT + "managers.scheduler_components.output_streamer.SchedulerOutputStreamer."
         "is_request_level_customized_info_key", "around", _request_level_key, "provenance sent once per request"),
    Hook(_SRT + "managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_all_pools",
         "after", _idle_pool_check, "with ``stats_path``: log the idle pool (tests)"),
)
"""Every hook of the plugin, in the order ``register_hooks`` installs them."""


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in HOOKS:
        HookRegistry.register(hook.target, hook.fn, HookType(hook.kind))
