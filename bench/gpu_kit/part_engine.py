"""Part ``engine``: the HF reference engine decoding dense vs R-KV vs SnapKV, tokens/s and memory per sequence.

``eng_prompts`` random prompts x ``eng_samples`` samples, all decoded together (one chunk of
``eng_rows`` rows), T = 1, EOS ignored so every response is ``eng_response`` tokens. Each method gets an equal
share of the part's time left; a method that runs out stops at its step (``Deadline``) and its record keeps
the steps done, so the ratios then compare the methods over the steps all of them reached.

Measured, without changing the engine (its decoder and its caches are wrapped on the instance, bench only):
decode tokens/s from the time between decode calls (the engine syncs on every step's sampled tokens), the same
over the last eighth of the response (where dense attends the most), the cache's own bytes per sequence (its
K/V/positions/query-window tensors as allocated), the peak memory above the weights during ``generate``
(``records.PeakMeter``), compression events and their share of the time, and how many sequences fit in
``eng_memory_budget_bytes`` at the measured peak per sequence. The planner's KV bytes per sequence
(``planning.kv``) stand beside them.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from gpu_kit.part_model import MODEL_DIR
from gpu_kit.records import Deadline, PeakMeter, Recorder, gib, sync
from gpu_kit.sizes import Sizes

METHODS = ("none", "rkv", "snapkv")
"""Dense first: the reference the others are divided by."""
PROFILE_POINTS = 8
"""Cumulative decode seconds are kept at every 1/8 of the response (for the common-prefix ratios)."""
TEARDOWN_S = 4.0
"""Seconds kept back from each method's share for freeing its cache and writing the record."""


def _label(method: str) -> str:
    return "dense" if method == "none" else method


def sdpa_probe(rows: int, q_heads: int, kv_heads: int, head_dim: int, length: int, device: torch.device) -> dict:
    """Which SDPA backends accept the engine's decode call (bool mask + ``enable_gqa``), and their ms per call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16
    q = torch.randn(rows, q_heads, 1, head_dim, device=device, dtype=dtype)
    k = torch.randn(rows, kv_heads, length, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=device)
    out = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        with warnings.catch_warnings(record=True) as why:  # torch says why a backend declines, as warnings
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    sync()
                    start = time.perf_counter()
                    for _ in range(3):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    sync()
                out[backend.name.lower()] = f"ok, {1000 * (time.perf_counter() - start) / 3:.3f} ms"
            except RuntimeError as exc:
                reasons = [str(w.message).split("(Triggered")[0].strip() for w in why] or [str(exc).splitlines()[0]]
                out[backend.name.lower()] = "refused: " + "; ".join(dict.fromkeys(reasons))[:300]
    return dict(shape=f"q [{rows}, {q_heads}, 1, {head_dim}], kv [{rows}, {kv_heads}, {length}, {head_dim}]", **out)


class _Instrument:
    """Wraps one engine's decoder and caches (instance attributes): step times, cache bytes, compressions."""

    def __init__(self, engine, deadline: float):
        self.marks: list[float] = []
        self.cache_bytes_per_seq = 0
        self.events = 0
        self.compress_s = 0.0
        decode, new_cache = engine.decoder.decode, engine._new_cache

        def timed_decode(tokens, cache, forced_routing=None):
            self.marks.append(time.perf_counter())
            if len(self.marks) == 1:
                held = (cache.k, cache.v, cache.pos, cache.acc, cache.qwin)
                self.cache_bytes_per_seq = sum(t.nbytes for t in held if t is not None) // cache.rows
            if time.monotonic() > deadline:
                raise Deadline(f"stopped after {len(self.marks) - 1} decode steps")
            return decode(tokens, cache, forced_routing)

        def counted_cache(rows, capacity, config):
            cache = new_cache(rows, capacity, config)
            compress = cache.compress

            def timed_compress(which):
                sync()
                start = time.perf_counter()
                compress(which)
                sync()
                self.compress_s += time.perf_counter() - start
                self.events += int(which.numel())

            cache.compress = timed_compress
            return cache

        engine.decoder.decode = timed_decode
        engine._new_cache = counted_cache


def measure(model, method: str, sizes: Sizes, prompts: list[list[int]], deadline: float, m: dict) -> None:
    """Decode one batch with ``method``; fills ``m`` as it goes (a ``Deadline`` leaves the steps done in it)."""
    from sparse_rl_megatron.compression import CompressionConfig, CompressionSchedule
    from sparse_rl_megatron.models.arch import arch_from_hf_config
    from sparse_rl_megatron.planning.kv import kv_bytes_per_token
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine

    rows, response = sizes.eng_rows, sizes.eng_response
    compression = CompressionConfig(method=method, budget=sizes.eng_budget, buffer=sizes.eng_buffer,
                                    window=sizes.eng_window)
    arch = arch_from_hf_config(model.config.to_dict())
    planned = CompressionSchedule(compression).capacity(sizes.eng_prompt_len, response) * kv_bytes_per_token(arch)
    m.update(rows=rows, response=response, planned_kv_mib_per_seq=round(planned / 2**20, 3),
             budget=None if method == "none" else f"B={sizes.eng_budget} W={sizes.eng_buffer} alpha={sizes.eng_window}")
    engine = HFRolloutEngine(model, compression=compression, dtype=torch.bfloat16, max_batch_size=rows,
                             show_progress=False)
    probe = _Instrument(engine, deadline)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=response, ignore_eos=True, seed=0)
    meter = PeakMeter()
    start = time.perf_counter()
    try:
        with meter:
            samples = engine.generate(prompts, sizes.eng_samples, sampling)
        end = time.perf_counter()
        assert all(len(s.response_ids) == response for s in samples), "a response stopped early (EOS ignored)"
        m["complete"] = True
    finally:
        marks = probe.marks
        steps = len(marks) - 1 if m.get("complete") is None else len(marks)
        last = marks[-1] if m.get("complete") is None else end
        decode_s = last - marks[0] if marks else 0.0
        m.update(complete=bool(m.get("complete")), decode_steps=steps,
                 prefill_s=round(marks[0] - start, 3) if marks else None,
                 decode_s=round(decode_s, 3), decode_tok_s=round(rows * steps / decode_s, 1) if decode_s else None,
                 cum_s=_profile(marks, response), events_per_seq=round(probe.events / rows, 2),
                 compress_share=round(probe.compress_s / decode_s, 4) if decode_s else None,
                 cache_mib_per_seq=round(probe.cache_bytes_per_seq / 2**20, 3))
        tail = max(1, response // PROFILE_POINTS)
        if len(marks) > tail:
            m["end_tok_s"] = round(rows * tail / (marks[-1] - marks[-1 - tail]), 1)
        if meter.peak:
            per_seq = meter.rise / rows
            m.update(peak_rise_gib=gib(meter.rise), peak_mib_per_seq=round(per_seq / 2**20, 3),
                     fits_in_budget=int(sizes.eng_memory_budget_bytes // per_seq) if per_seq else None,
                     fits_in_budget_by_cache=int(sizes.eng_memory_budget_bytes // probe.cache_bytes_per_seq)
                     if probe.cache_bytes_per_seq else None)


def _profile(marks: list[float], response: int) -> dict:
    """Decode seconds after every 1/8 of the response (step -> seconds), for the steps reached."""
    every = max(1, response // PROFILE_POINTS)
    return {str(s): round(marks[s] - marks[0], 3) for s in range(every, len(marks), every)}


def compare(results: dict[str, dict]) -> dict:
    """Each method against dense: tokens/s over the steps every method reached, memory per sequence, fits."""
    dense = results.get("dense")
    if not dense or not dense.get("cum_s"):
        return dict(note="dense did not reach the first profile point; no ratios")
    common = set(dense["cum_s"])
    for r in results.values():
        common &= set(r.get("cum_s") or {})
    out = {}
    if common:
        step = max(common, key=int)
        out["common_steps"] = int(step)
        for name, r in results.items():
            out[f"{name}_tok_s_x_dense"] = round(dense["cum_s"][step] / r["cum_s"][step], 3)
    for name, r in results.items():
        if r.get("peak_mib_per_seq") and dense.get("peak_mib_per_seq"):
            out[f"{name}_peak_per_seq_x_dense"] = round(r["peak_mib_per_seq"] / dense["peak_mib_per_seq"], 4)
        if r.get("fits_in_budget") and dense.get("fits_in_budget"):
            out[f"{name}_fits_x_dense"] = round(r["fits_in_budget"] / dense["fits_in_budget"], 2)
    return out


def run(rec: Recorder, sizes: Sizes, work: Path, device: torch.device) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(work / MODEL_DIR, dtype=torch.bfloat16, local_files_only=True)
    model = model.to(device).eval()
    cfg = model.config
    with rec.item("SDPA backends for the engine's decode attention") as m:
        m.update(sdpa_probe(sizes.eng_rows, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.hidden_size // cfg.num_attention_heads, sizes.eng_prompt_len + sizes.eng_response,
                            device))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (sizes.eng_prompt_len,), generator=g).tolist()
               for _ in range(sizes.eng_prompts)]
    results: dict[str, dict] = {}
    for i, method in enumerate(METHODS):
        share = rec.left() / (len(METHODS) - i) - TEARDOWN_S
        with rec.item(f"decode {_label(method)}") as m:
            results[_label(method)] = m
            measure(model, method, sizes, prompts, time.monotonic() + share, m)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rec.write("dense vs compressed", **compare(results))
