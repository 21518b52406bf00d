"""What each GPU inner backend reads, built through the plugin's runner view: the plugin's physical table row of
every request, cut at its physical length (never SGLang's logical row, which after a compression holds evicted
zeros and misses the newest tokens).

The plugin runs in-process over SGLang's real pools (``plugin_rig``); after some requests compressed, the index
building code of each backend runs on the batch the plugin hands its inner backend:

- triton: ``TritonAttnBackend._fill_kv_indptr_and_indices`` (what its ``init_forward_metadata`` calls for decode
  and extend), i.e. ``pack_read_stream`` and Triton's ``create_flashinfer_kv_indices_triton`` in the interpreter;
- flashinfer: ``FlashInferIndicesUpdaterDecode/Prefill.update_single_wrapper`` -> ``call_begin_forward``, SGLang's
  code as it is, up to flashinfer's planner (a CUDA library, not installed here): a recorder takes its place and
  keeps the index stream SGLang hands it;
- fa3: ``FlashAttentionBackend.init_forward_metadata`` (torch), whose page table and cache lengths the kernel reads.

The backend objects are made with ``__new__`` and given the attributes their ``__init__`` takes from the runner
view (a full ``__init__`` needs CUDA libraries); the methods that build the indices are SGLang's own.
"""
from __future__ import annotations

import pytest
import torch
from plugin_rig import HEAD_DIM, KV_HEADS, Q_HEADS, PluginRig

from sglang_ext.config import SparseKVConfig
from sparse_rl_megatron.compression import CompressionConfig

CONFIG = SparseKVConfig(compression=CompressionConfig(method="rkv", budget=6, window=2, buffer=2))
PROMPTS = [5, 11, 3]


@pytest.fixture(scope="module")
def rig():
    """Three requests prefilled and decoded until all compressed at least once (one twice), evicted slots freed."""
    rig = PluginRig(CONFIG, rows=4, context=64, pool_tokens=256)
    rows = rig.admit(len(PROMPTS))
    rig.forward(rows, PROMPTS, decode=False)
    for _ in range(7):
        rig.forward(rows, 1, decode=True)
    assert (rig.backend.state.events[rows] >= 1).all() and rig.backend.state.events[rows].max() >= 2
    rig.rows = rows
    yield rig
    rig.close()


def _expected(rig, phys, rows):
    """The plugin's table rows at the physical lengths, checked against the batch's physical lengths."""
    want = rig.physical_rows(rows)
    assert phys.seq_lens.tolist() == [w.numel() for w in want]
    logical = [rig.seq[r] for r in rows]
    assert all(w.numel() < n for w, n in zip(want, logical)), "a request should be compressed"
    return want


def _csr(indptr, indices, bs):
    return [indices[int(indptr[i]):int(indptr[i + 1])].long() for i in range(bs)]


def _assert_rows(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g.tolist(), w.tolist())


def test_triton_kv_indices_are_the_physical_rows(rig):
    from triton.runtime.interpreter import InterpretedFunction

    from sglang.kernels.ops.attention import kv_indices
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert isinstance(kv_indices.create_flashinfer_kv_indices_triton, InterpretedFunction), (
        "SGLang was imported before sglang_ext.cpu_compat.apply() set TRITON_INTERPRET=1")
    view = rig.backend.runner_view
    triton = TritonAttnBackend.__new__(TritonAttnBackend)
    triton.kv_index_translator = view.kv_index_translator          # as TritonAttnBackend.__init__ takes them
    triton.kv_indptr = torch.zeros(view.req_to_token_pool.size + 1, dtype=torch.int32)

    def check(phys):
        bs = phys.batch_size
        want = _expected(rig, phys, rig.rows)
        out = torch.empty(int(phys.seq_lens_sum), dtype=torch.int64)
        indptr = triton._fill_kv_indptr_and_indices(phys.kv_loc_plan, bs, phys.seq_lens, phys.req_pool_indices, out)
        _assert_rows(_csr(indptr, out, bs), want)
        check.ran = True

    rig.forward(rig.rows, 1, decode=True, inspect=check)
    assert check.ran


class PlannerRecorder:
    """Stands in for a flashinfer wrapper (its planner is CUDA code): keeps the (indptr, indices) SGLang plans
    with. ``is_cuda_graph_enabled`` makes SGLang's decode path write the indices into ``_paged_kv_indices_buf``
    (else it allocates them on the CUDA device)."""

    is_cuda_graph_enabled = True
    _custom_mask_buf = None

    def __init__(self, size: int):
        self._paged_kv_indices_buf = torch.zeros(size, dtype=torch.int32)
        self.calls = []

    def begin_forward(self, *args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.calls.append([t.clone() for t in tensors])


def _flashinfer_backend(view):
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    fi = FlashInferAttnBackend.__new__(FlashInferAttnBackend)
    fi.kv_index_translator = view.kv_index_translator   # __init__: model_runner.kv_index_translator
    fi.dq_paged_kernel_lens = None
    return fi


def _updater(cls, fi, view):
    up = cls.__new__(cls)
    up.attn_backend, up._swa_kv_pool, up.sliding_window_size = fi, None, None
    up.num_qo_heads, up.num_kv_heads, up.head_dim = Q_HEADS, KV_HEADS, HEAD_DIM
    up.data_type = up.q_data_type = torch.float32
    size = view.req_to_token_pool.size + 1
    up.kv_indptr = [torch.zeros(size, dtype=torch.int32)]
    up.qo_indptr = [torch.zeros(size, dtype=torch.int32)]
    up.kv_last_page_len = torch.ones(size, dtype=torch.int32)
    up.prefill_wrapper_ragged = None
    return up


def test_flashinfer_decode_and_prefill_plans_read_the_physical_rows(rig):
    from sglang.srt.layers.attention.flashinfer_backend import (FlashInferIndicesUpdaterDecode,
                                                                FlashInferIndicesUpdaterPrefill)

    view = rig.backend.runner_view
    fi = _flashinfer_backend(view)
    decode = _updater(FlashInferIndicesUpdaterDecode, fi, view)
    prefill = _updater(FlashInferIndicesUpdaterPrefill, fi, view)
    wrapper = PlannerRecorder(1024)

    def check_decode(phys):   # FlashInferAttnBackend.init_forward_metadata, decode branch
        want = _expected(rig, phys, rig.rows)
        decode.update_single_wrapper(phys.seq_lens, phys.seq_lens_cpu, phys.seq_lens_sum, [wrapper], None, None,
                                     plan=phys.kv_loc_plan, req_pool_indices=phys.req_pool_indices)
        indptr, indices = wrapper.calls[-1][:2]
        _assert_rows(_csr(indptr, indices, phys.batch_size), want)

    rig.forward(rig.rows, 1, decode=True, inspect=check_decode)
    assert wrapper.calls

    # an extend next to compressed requests: a new request's prefill (flashinfer's paged prefix part reads
    # the physical prefix, here empty), planned over the same table
    (new,) = rig.admit(1)

    def check_prefill(phys):
        prefill.update_single_wrapper(phys.req_pool_indices, phys.seq_lens, phys.seq_lens_cpu, phys.seq_lens_sum,
                                      phys.extend_prefix_lens, [wrapper], False, None, None,
                                      extend_prefix_lens_cpu=phys.extend_prefix_lens_cpu, plan=phys.kv_loc_plan)
        qo_indptr, kv_indptr, kv_indices = wrapper.calls[-1][:3]
        _assert_rows(_csr(kv_indptr, kv_indices, phys.batch_size), rig.physical_rows([new]))
        assert qo_indptr.tolist() == [0, 4]

    rig.forward([new], 4, decode=False, inspect=check_prefill)


def test_fa3_page_table_is_the_physical_rows(rig):
    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend

    view = rig.backend.runner_view
    fa = FlashAttentionBackend.__new__(FlashAttentionBackend)
    # what FlashAttentionBackend.__init__ takes from the runner view, and its settings for this model
    fa.req_to_token_pool, fa.req_to_token = view.req_to_token_pool, view.req_to_token_pool.req_to_token
    fa.token_to_kv_pool, fa.kv_index_translator = view.token_to_kv_pool, view.kv_index_translator
    fa.max_context_len, fa.page_size, fa.topk, fa.speculative_num_steps = 64, 1, 0, 0
    fa.is_prefill_aware_swa = fa.has_swa = fa.use_sliding_window_kv_pool = fa.use_mla = False
    fa.local_attn_builder = fa._kv_shard_pool = fa._get_scheduler_metadata = None

    def check(phys):
        want = _expected(rig, phys, rig.rows)
        fa.init_forward_metadata(phys)
        m = fa.forward_metadata
        lens = m.cache_seqlens_int32.tolist()
        _assert_rows([m.page_table[i, :lens[i]].long() for i in range(phys.batch_size)], want)

    rig.forward(rig.rows, 1, decode=True, inspect=check)
