"""``sparse_kv``: an SGLang attention backend that wraps a real one and bounds every request's KV.

The inner backend (``torch_native`` on CPU; ``triton``, ``flashinfer``, ``fa3`` on GPU) runs the kernels
unchanged: it is built on a view of the model runner (``runner_view``) whose ``req_to_token_pool.req_to_token``
is the plugin's physical table (``row_state``) and whose ``kv_index_translator`` reads that table, and every
forward hands it a ``ForwardBatch`` copy with physical lengths (``forward_plan``). The model, RoPE positions and SGLang's scheduler keep the logical lengths.

Around that, per forward: ``init_forward_metadata`` updates the tables; each layer's ``forward_*`` stores
the post-RoPE queries the scorers need (a ring of the last alpha per row and layer; TriAttention's running
query-center sums, ``query_centers``); after the forward
(``after_forward``, hooked on ``ModelRunner.forward``, outside any graph) the rows that reached B + W are
compressed and their evicted slots freed (``compaction``).
"""
from __future__ import annotations

import logging
import sys

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_ext import admission, host_syncs, memory
from sglang_ext.config import BACKEND_NAME, REQUEST_KEY, ConfigError, PluginFaults, SparseKVConfig, request_compression
from sglang_ext.forward_plan import (ForwardPlan, check_tables, follow_rewrite, plan_forward, sglang_host,
                                     written_positions)
from sglang_ext.host_syncs import counted, not_counted
from sglang_ext.query_centers import add_queries, rope_inv_freq
from sglang_ext.refusals import refuse_at_model_load, routed_experts_message
from sglang_ext.row_state import RowInfo, RowState
from sglang_ext.runner_view import (RunnerView, kv_cache_region, physical_translator, query_groups,
                                    tp_rank)
from sparse_rl_megatron.compression import KeptDigest

logger = logging.getLogger(__name__)

_ACTIVE: "SparseKVBackend | None" = None
"""The backend of this process (SGLang runs one scheduler, hence one target model runner, per process)."""
UNSUPPORTED_BASE_METHODS = {
    "init_cuda_graph_state": "CUDA graphs",
    "init_forward_metadata_for_breakable_cuda_graph_capture": "breakable CUDA graphs",
    "prepare_forward_metadata_for_breakable_cuda_graph_replay": "breakable CUDA graphs",
    "update_verify_buffers_to_fill_after_draft": "speculative decoding",
    "forward_mixed": "mixed prefill/decode chunks",
}
"""Methods ``AttentionBackend`` leaves raising that this backend does not implement: their feature is refused at
start (``refusals``). Every other raising method is implemented here."""
PADDED_SEQ_LEN = 1
"""Sequence length of a padded batch lane when the inner backend names none (triton, flashinfer, fa3 use 1)."""


def active_backend() -> "SparseKVBackend | None":
    return _ACTIVE


class SparseKVBackend(AttentionBackend):
    """Compressed-KV attention: per layer and KV head selection, evicted slots given back to SGLang."""

    def __init__(self, model_runner, config: SparseKVConfig):
        super().__init__()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        _claim_process(None)
        self.closed = False
        refuse_at_model_load(model_runner)   # before anything reads the pool: the layouts it cannot serve
        pool = model_runner.token_to_kv_pool
        self.config = config
        self.faults = PluginFaults.from_env()
        """Test-only fault injection (``config.FAULT_ENV``), read once here."""
        self.runner = model_runner
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.tree_cache = None  # set by the scheduler hook; used to evict cached prefixes when slots run short
        self.radix_enabled = not bool(getattr(model_runner.server_args, "disable_radix_cache", False))
        rtt = self.req_to_token_pool.req_to_token
        mc = model_runner.model_config
        self.layer_ids = list(range(pool.start_layer, pool.start_layer + pool.layer_num))
        tp = int(getattr(model_runner.server_args, "tp_size", 1) or 1)
        num_q_heads = mc.get_num_attention_heads(tp)
        self.query_groups = query_groups(mc, tp)
        c = config.compression
        self.memory = memory.for_config(config, rows=rtt.shape[0], width=rtt.shape[1], layers=len(self.layer_ids),
                                        q_heads=num_q_heads, kv_heads=pool.head_num, head_dim=pool.head_dim,
                                        ring_itemsize=torch.empty(0, dtype=model_runner.dtype).element_size())
        self.state = RowState(
            rows=rtt.shape[0], width=rtt.shape[1], num_layers=len(self.layer_ids), num_kv_heads=pool.head_num,
            num_q_heads=num_q_heads, head_dim=pool.head_dim, window=c.window, max_candidates=c.max_candidates,
            ring_dtype=model_runner.dtype, device=rtt.device, keep_queries=not c.is_dense,
            keep_positions=config.kept_digest and not c.is_dense, keep_centers=memory.keeps_centers(c),
            region=kv_cache_region(model_runner))
        self.inv_freq = (rope_inv_freq(mc.hf_config, pool.head_dim).to(rtt.device)
                         if self.state.qsum is not None else None)
        """[D / 2] the rotary frequencies the query centers are un-rotated with (``query_centers``)."""
        inner_name = config.resolved_inner_backend(str(self.device))
        self.runner_view = RunnerView(model_runner, self.state.table, physical_translator(model_runner,
                                                                                           self.state.table))
        """What the inner backend was built on (its tables, its index translator)."""
        self.inner = ATTENTION_BACKENDS[inner_name](self.runner_view)
        self.scaling: dict[int, float] = {}
        self.plan: ForwardPlan | None = None
        self._last_idle = None
        self.forwards = 0
        self.syncs_logged = 0
        self.compact_cpu = 0.0
        self.appending = False
        """Set by the scheduler hook while SGLang writes the coming decode tokens' slots (new positions)."""
        """With ``stats_path``: forwards seen and this process's CPU seconds spent compressing (cumulative)."""
        self.sglang_clip = admission.sglang_clip()
        """SGLang's clip of the future tokens admission reserves per request; a compressed request's own bound is
        smaller (``admission.request_bound``)."""
        self.sync_counter = None
        if config.count_host_syncs and config.stats_path:
            self.sync_counter = host_syncs.HostSyncCounter()
            host_syncs.install_for_process(self.sync_counter)
        _claim_process(self)
        self._report_memory()
        logger.info("sparse_kv backend: %s, inner %s", c.describe(), inner_name)

    # ------------------------------------------------------------------------------------------- binding
    def make_info(self, row: int, prompt_len: int, req=None) -> RowInfo:
        """The row facts of a new request (its compression config validated here)."""
        overrides = None
        if req is not None:
            overrides = (getattr(req.sampling_params, "custom_params", None) or {}).get(REQUEST_KEY)
        base = self.config.compression
        config = request_compression(base, overrides)
        if not config.is_dense and base.is_dense:
            raise ConfigError("custom_params.sparse_kv: this server was started dense (compression.method none); "
                              "start it with a compression method to compress requests")
        if req is not None and req.return_routed_experts and not config.is_dense:
            raise ConfigError(routed_experts_message())
        meta = {"method": config.method, "budget": None if config.is_dense else config.budget,
                "window": 0 if config.is_dense else config.window, "buffer": 0 if config.is_dense else config.buffer,
                "scope": config.scope, "events": 0, "peak_kv_tokens": 0, "kept_digest": None,
                "logprobs": _logprob_convention(), "retractions": int(getattr(req, "retraction_count", 0) or 0)}
        digest = KeptDigest() if self.state.pos is not None and not config.is_dense else None
        return RowInfo(config=config, prompt_len=prompt_len, req=req, meta=meta, digest=digest)

    def bind(self, row: int, req) -> None:
        """Scheduler side: ``req`` now owns ``row`` (called right after SGLang allocated the row)."""
        generation = int(sglang_host(self.req_to_token_pool.req_generation)[row])
        info = self.state.info[row]
        if self.state.generation[row] == generation and info is not None and info.req is req:
            return  # a chunked prefill continuing in its row
        old = getattr(req, "customized_info", None) or {}
        previous = old.get(REQUEST_KEY)
        info = self.make_info(row, len(req.origin_input_ids), req)
        if previous:  # a retracted request re-prefilled: keep what its first attempt recorded
            info.meta = {**previous[0], "retractions": info.meta["retractions"]}
        self.state.reset(row, generation, info)
        req.customized_info = {**old, REQUEST_KEY: [info.meta]}

    # ------------------------------------------------------------------------------------------ forward
    @counted
    def init_forward_metadata(self, forward_batch):
        if getattr(forward_batch, "global_num_tokens_cpu", None) is not None:
            raise ConfigError(f"{BACKEND_NAME}: this server pads batches for MLP sync (attention DP, gathered "
                              "buffers); padded lanes would read request row 0; not supported")
        if forward_batch.forward_mode.is_idle():
            self.plan = None
            with not_counted():
                self.inner.init_forward_metadata(forward_batch)
            return
        self.plan = plan_forward(
            self.state, forward_batch, req_to_token=self.req_to_token_pool.req_to_token,
            req_generation=self.req_to_token_pool.req_generation,
            default_info=lambda row, seq: self.make_info(row, seq))
        if self.config.check_tables:
            self._check_tables()
        with not_counted():   # the inner backend's own metadata (what it costs without the plugin too)
            self.inner.init_forward_metadata(self.plan.phys_batch)

    def _check_tables(self) -> None:
        """``check_tables``: a request whose table drifted from SGLang's row is aborted with what differs (an
        exception here would take the scheduler down, and SGLang the process that started it); a row driven
        without a scheduler (unit tests) raises."""
        for row, message in check_tables(self.state, self.plan.rows, self.req_to_token_pool.req_to_token).items():
            req = self.state.info[row].req
            if req is None:
                raise RuntimeError(message)
            from sglang.srt.managers.schedule_batch import FINISH_ABORT

            logger.error(message)
            req.to_finish = FINISH_ABORT(message)

    @counted
    def follow_write(self, indices) -> None:
        """Scheduler side, after ``ReqToTokenPool.write(indices, ...)``: the bound rows' tables follow the rewrite
        (``forward_plan.follow_rewrite``); rows no request of the plugin holds yet are left to their first plan."""
        if self.appending:   # the coming decode tokens' slots: new positions, read from out_cache_loc
            return
        if self.faults.stale_tables:
            return   # fault injection for tests: the tables keep slots SGLang freed (the defect of issue 25)
        rtt = self.req_to_token_pool.req_to_token
        generation = sglang_host(self.req_to_token_pool.req_generation)
        for row, positions in written_positions(indices, rtt.shape[1]):
            if self.state.generation[row] == generation[row]:
                follow_rewrite(self.state, row, positions, rtt, radix=self.radix_enabled)

    @counted
    def _record_queries(self, q: torch.Tensor, layer) -> None:
        plan = self.plan
        self.scaling.setdefault(layer.layer_id, float(layer.scaling))
        if plan is None or (plan.ring_count == 0 and plan.center_count == 0):
            return
        q = q.reshape(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
        li = layer.layer_id - self.layer_ids[0]
        if plan.ring_count:
            ring = self.state.qwin[li]
            ring[plan.ring_rows, :, plan.ring_slots] = q[plan.ring_tokens].to(ring.dtype)
        if plan.center_count:
            add_queries(self.state.qsum[li], self.state.qabs[li], q[plan.center_tokens], plan.center_rows,
                        plan.center_positions, self.inv_freq)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._record_queries(q, layer)
        return self.inner.forward_decode(q, k, v, layer, self.plan.phys_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._record_queries(q, layer)
        return self.inner.forward_extend(q, k, v, layer, self.plan.phys_batch, save_kv_cache=save_kv_cache, **kwargs)

    def support_triton(self):
        return self.inner.support_triton()

    # Methods the base class leaves raising that SGLang calls outside CUDA graphs too: the fill value of padded
    # sequence lengths (batch padding, the decode-buffer allocation of FlashInfer's autotune warm-up). The inner
    # backend's answer (1 for triton, flashinfer, fa3); torch_native defines none, and 1 is what the others use.
    def get_cuda_graph_seq_len_fill_value(self):
        fill = getattr(type(self.inner), "get_cuda_graph_seq_len_fill_value", None)
        if fill is None or fill is AttentionBackend.get_cuda_graph_seq_len_fill_value:
            return PADDED_SEQ_LEN
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def get_cpu_graph_seq_len_fill_value(self):
        fill = getattr(self.inner, "get_cpu_graph_seq_len_fill_value", None)
        return PADDED_SEQ_LEN if fill is None else fill()

    def close(self) -> None:
        """Drop this backend's claim on the process (in-process drivers; a server's ends with its process)."""
        global _ACTIVE
        self.closed = True
        if _ACTIVE is self:
            _ACTIVE = None

    @counted
    def after_forward(self) -> None:
        """Compress the rows that reached B + W (called after the model forward, outside any graph)."""
        from sglang_ext.compaction import compress_due_rows

        plan, self.plan = self.plan, None
        if plan is not None:
            compress_due_rows(self, plan)

    # ------------------------------------------------------------------------------------------- helpers
    def _report_memory(self) -> None:
        """One line at start: the plugin's memory, and whether SGLang's KV budget was reduced by it first."""
        held = memory.reserved()
        where = (f"inside mem_fraction_static (reserved {held.total / 2 ** 30:.2f} GiB for {held.rows} rows before "
                 "the KV pool was sized)" if held is not None else "not reserved before the KV pool was sized")
        if tp_rank(self.runner) == 0:
            print(f"{self.memory.describe()}, {where}", file=sys.stderr, flush=True)
        if self.config.stats_path:
            from sglang_ext.compaction import _append

            _append(self, {"memory": {"allocated": self.state.nbytes, "formula": self.memory.total,
                                      "rows": self.memory.rows, "reserved": None if held is None else held.total,
                                      "reserved_rows": None if held is None else held.rows}})

    @property
    def compresses(self) -> bool:
        """Requests are compressed and their evicted slots freed (admission may count on it)."""
        return not self.config.compression.is_dense and self.config.free_evicted


def _claim_process(backend: "SparseKVBackend | None") -> None:
    """Make ``backend`` this process's backend; None: only check that no live one exists."""
    global _ACTIVE
    if _ACTIVE is not None and not _ACTIVE.closed:
        raise ConfigError(f"{BACKEND_NAME}: a second {BACKEND_NAME} attention backend was built in this process "
                          "(two-batch overlap, PD multiplexing, a draft model or another runner); the plugin keeps "
                          "one table per request row and supports one backend per process")
    if backend is not None:
        _ACTIVE = backend


def _logprob_convention() -> str:
    """``t1`` when SGLang returns unscaled log-probs (SGLANG_RETURN_ORIGINAL_LOGPROB), else ``scaled``."""
    from sglang.srt.layers import sampler

    return "t1" if sampler.SGLANG_RETURN_ORIGINAL_LOGPROB else "scaled"
