"""The ``sparse_kv`` backend driven in-process, without an engine: SGLang's real pools, allocator, index
translator, ``ForwardBatch`` and ``RadixAttention`` layers, the real inner backend (torch_native), and a
holder of the ``ModelRunner`` attributes the backends read (a model runner cannot be built without a model
and a server).

A forward (:meth:`PluginRig.forward`) is what SGLang's model runner does to the attention backend:
allocate the new tokens' slots and write them into ``req_to_token`` (``alloc_for_extend/decode``), build a
``ForwardBatch`` and bind its KV plan, ``init_forward_metadata``, every layer's ``forward_extend/decode`` with
random post-RoPE q/k/v, then the plugin's after-forward compaction.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16


class RunnerAttributes:
    """The ``ModelRunner`` attributes SparseKVBackend and the inner backends read, over real SGLang pools."""

    def __init__(self, *, rows: int, context: int, pool_tokens: int, radix: bool = False, tp_size: int = 1,
                 max_running_requests: int | None = None):
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.device, self.dtype, self.page_size, self.gpu_id = "cpu", torch.float32, 1, 0
        self.is_draft_worker = self.use_mla_backend = False
        self.sliding_window_size = None
        self.model = torch.nn.Module()
        """The loaded model (the backend reads its attention layers' windows at model load)."""
        self.req_to_token_pool = ReqToTokenPool(size=rows, max_context_len=context, device="cpu",
                                                enable_memory_saver=False)
        self.token_to_kv_pool = MHATokenToKVPool(pool_tokens, page_size=1, dtype=torch.float32, head_num=KV_HEADS,
                                                 head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                                                 enable_memory_saver=False, enable_alt_stream=False)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(pool_tokens, torch.float32, "cpu",
                                                                 kvcache=self.token_to_kv_pool, need_sort=False)
        self.kv_index_translator = KVIndexTranslator(
            req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, token_to_kv_pool=self.token_to_kv_pool,
            page_size=1, device="cpu")
        self.model_config = SimpleNamespace(get_num_attention_heads=lambda tp: Q_HEADS // tp, context_len=context,
                                            get_total_num_kv_heads=lambda: KV_HEADS, num_attention_heads=Q_HEADS,
                                            is_encoder_decoder=False,
                                            hf_config=SimpleNamespace(rope_parameters={"rope_theta": 10000.0,
                                                                                       "rope_type": "default"}))
        self.server_args = SimpleNamespace(tp_size=tp_size, disable_radix_cache=not radix)
        self.max_running_requests = max_running_requests or rows


@contextlib.contextmanager
def published_parallel():
    """The parallel widths a scheduler process publishes (TP 1, no decode context parallelism)."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1):
        yield


class PluginRig:
    """One SparseKVBackend over real pools; ``seq[row]`` is each row's logical length."""

    def __init__(self, config, *, rows: int = 4, context: int = 64, pool_tokens: int = 512, seed: int = 0):
        from sglang.srt.layers.radix_attention import RadixAttention

        from sglang_ext.backend import SparseKVBackend

        self.runner = RunnerAttributes(rows=rows, context=context, pool_tokens=pool_tokens)
        with published_parallel():
            self.backend = SparseKVBackend(self.runner, config)
        self.layers = [RadixAttention(Q_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, layer_id=i)
                       for i in range(LAYERS)]
        self.seq: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(seed)

    def admit(self, count: int) -> list[int]:
        """New requests: rows handed out by SGLang's row pool (the plugin binds them at their first forward)."""
        pool = self.runner.req_to_token_pool
        rows = pool.alloc_rows(count)
        for row in rows:
            self.seq[row] = 0
        return list(rows)

    def forward(self, rows: list[int], new_tokens: list[int] | int, *, decode: bool, inspect=None,
                host_rows: bool = True):
        """One forward of ``rows``, each caching ``new_tokens`` tokens (1 for decode). ``inspect(phys_batch)``
        is called after ``init_forward_metadata`` with the batch the inner backend received. Returns the
        ForwardBatch the plugin received."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        new = [new_tokens] * len(rows) if isinstance(new_tokens, int) else list(new_tokens)
        rtt = self.runner.req_to_token_pool.req_to_token
        out = self.runner.token_to_kv_pool_allocator.alloc(sum(new))
        assert out is not None, "the rig's KV pool is full"
        start = 0
        for row, e in zip(rows, new):
            rtt[row, self.seq[row]:self.seq[row] + e] = out[start:start + e].to(rtt.dtype)
            self.seq[row] += e
            start += e
        seq = torch.tensor([self.seq[r] for r in rows], dtype=torch.int64)
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        fb = ForwardBatch(forward_mode=mode, batch_size=len(rows), input_ids=torch.zeros(sum(new), dtype=torch.int64),
                          req_pool_indices=torch.tensor(rows, dtype=torch.int64), seq_lens=seq.clone(),
                          out_cache_loc=out, seq_lens_sum=int(seq.sum()), seq_lens_cpu=seq.clone())
        if not decode:
            ext = torch.tensor(new, dtype=torch.int64)
            fb.extend_seq_lens, fb.extend_prefix_lens = ext, seq - ext
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(new), (seq - ext).tolist()
            fb.extend_num_tokens = sum(new)
        if host_rows:   # what SGLang (extend) and the plugin's ForwardBatch.init_new hook (decode) fill in
            fb.req_pool_indices_cpu = torch.tensor(rows, dtype=torch.int64)
        translator = self.runner.kv_index_translator
        translator.own_plan(fb).bind(fb, translator)
        self.backend.init_forward_metadata(fb)
        if inspect is not None:
            inspect(self.backend.plan.phys_batch)
        tokens = sum(new)
        for layer in self.layers:
            q = torch.randn(tokens, Q_HEADS * HEAD_DIM, generator=self.gen)
            k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=self.gen)
            v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=self.gen)
            if decode:
                self.backend.forward_decode(q, k, v, layer, fb)
            else:
                self.backend.forward_extend(q, k, v, layer, fb)
        self.backend.after_forward()
        return fb

    def release(self, row: int) -> None:
        """SGLang's release of a finished request: ``free_kv_row`` of its row (no radix tree), then the row."""
        from types import SimpleNamespace as KV

        from sglang_ext.accounting import handles_row, release_row

        kv = KV(req_pool_idx=row, cache_protected_len=0, kv_allocated_len=self.seq[row])
        rtt = self.runner.req_to_token_pool.req_to_token
        if handles_row(self.backend, row):
            release_row(self.backend, kv, [(0, self.seq[row])], self.runner.token_to_kv_pool_allocator)
        else:
            self.runner.token_to_kv_pool_allocator.free(rtt[row, :self.seq[row]].long())
        self.runner.req_to_token_pool.free_rows([row])
        del self.seq[row]

    def close(self) -> None:
        self.backend.close()

    def physical_rows(self, rows: list[int]) -> list[torch.Tensor]:
        """The plugin's table row of each request, cut at its physical length."""
        state = self.backend.state
        return [state.table[r, :int(state.phys_len[r])].long() for r in rows]
