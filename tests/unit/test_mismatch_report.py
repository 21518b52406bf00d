"""A budget study's rows, statistics, results document, table and histogram figure, on a hand-worked batch."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from sparse_rl_megatron.algo import CorrectionConfig, prepare_correction
from sparse_rl_megatron.algo.hooks import pad
from sparse_rl_megatron.compression.config import CompressionConfig
from sparse_rl_megatron.mismatch.measure import Measurement
from sparse_rl_megatron.mismatch.report import (
    COLUMNS,
    HISTOGRAM_BINS,
    build_table,
    dense_check,
    plot_histograms,
    results_document,
)
from sparse_rl_megatron.mismatch.study import rejecting_correction, row_result, study_rows
from sparse_rl_megatron.rollout.sample import CompressionInfo, Sample
from sparse_rl_megatron.trainer.step import RolloutBatch, rollout_metrics

L = math.log
RKV = CompressionConfig(method="rkv", budget=32, window=4, buffer=8)


def _batch(log_rhos: list[list[float]], peaks=(5, 4), events=(1, 0)) -> RolloutBatch:
    """Two samples of one group: sampler log-probs -1 per token, pi_old = sampler + log rho."""
    samples = []
    for i, (lr, peak, ev) in enumerate(zip(log_rhos, peaks, events)):
        samples.append(Sample(prompt_ids=[1, 2, 3], response_ids=list(range(4, 4 + len(lr))),
                              sampler_logprobs=torch.full((len(lr),), -1.0), finish_reason="eos", group_id=0,
                              index_in_group=i, compression=CompressionInfo(events=ev, peak_kv_tokens=peak),
                              reward=float(i == 1)))
    sampler, mask = pad([s.sampler_logprobs for s in samples])
    old, _ = pad([s.sampler_logprobs + torch.tensor(lr) for s, lr in zip(samples, log_rhos)])
    prepared = prepare_correction(old, sampler, mask, torch.tensor([s.reward for s in samples]),
                                  torch.tensor([0, 0]), CorrectionConfig())
    return RolloutBatch(samples, None, prepared, metrics={**rollout_metrics(samples), **prepared.metrics})


def test_rows_are_dense_then_each_budget():
    rows = study_rows(RKV, [16, 64])
    assert [label for label, _ in rows] == ["dense", "rkv B=16", "rkv B=64"]
    assert rows[0][1].is_dense and [c.budget for _, c in rows[1:]] == [16, 64]
    assert all(dataclasses.replace(c, budget=32) == RKV for _, c in rows[1:])  # every other field as in the recipe
    with pytest.raises(ValueError, match="budget must be > window"):
        study_rows(RKV, [4])


def test_rejections_are_counted_with_sparse_rl_when_the_run_rejects_nothing():
    own = CorrectionConfig(rejection_upper=2.0)
    assert rejecting_correction(own) == (own, None)
    for mode in ("none", "reweight_only"):
        used, note = rejecting_correction(CorrectionConfig(mode=mode, rejection_lower=0.4))
        assert used == CorrectionConfig(mode="sparse_rl", rejection_lower=0.4)
        assert note.startswith(f"correction.mode '{mode}' rejects nothing; the rejection columns show what mode "
                               "'sparse_rl' would reject") and "outside [0.4, 1.5]" in note


def test_row_statistics_exact():
    # sample 0: rho 1, 0.5, 1e-5 (vetoed: 1e-5 < 1e-4); sample 1: rho 2 (rejected token), 1
    row = row_result("rkv B=32", RKV, _batch([[0.0, L(0.5), L(1e-5)], [L(2.0), 0.0]]))
    s = row.stats
    assert s["sparse/vetoed_seq_frac"] == 0.5 and s["sparse/rejected_token_frac"] == pytest.approx(4 / 5)
    assert s["rho/min"] == pytest.approx(1e-5) and s["rho/p50"] == pytest.approx(1.0)
    assert s["log_rho/seq_sum_min"] == pytest.approx(L(0.5) + L(1e-5))
    assert s["rollout/kv_tokens_peak_max"] == 5.0 and s["rollout/kv_tokens_peak_mean"] == 4.5
    assert s["rollout/kv_retained_frac"] == pytest.approx((5 / 6 + 4 / 5) / 2)  # peak over prompt + response
    assert s["rollout/response_len_mean"] == 2.5 and s["rollout/compression_events_mean"] == 0.5
    assert s["rollout/retracted_frac"] == s["rollout/redrawn_frac"] == 0.0   # no SGLang metadata: never retracted
    first, second = _batch([[0.0], [0.0]]).samples
    first.metadata.update(retractions=2, redraws=0)    # SGLang: retracted twice, re-prefilled
    second.metadata.update(retractions=0, redraws=1)   # refused after a compression, drawn again
    m = rollout_metrics([first, second, _batch([[0.0], [0.0]]).samples[0]])
    assert (m["rollout/retracted_frac"], m["rollout/redrawn_frac"]) == (1 / 3, 1 / 3)
    assert (m["rollout/retractions"], m["rollout/redraws"]) == (2.0, 1.0)   # counts, not fractions
    assert sorted(row.log_rho.tolist()) == pytest.approx(sorted([0.0, L(0.5), L(1e-5), L(2.0), 0.0]), abs=1e-6)
    first, second = row.samples
    assert first == {"group": 0, "index": 0, "source_id": None, "reward": 0.0, "response_tokens": 3,
                     "finish_reason": "eos", "compression_events": 1, "peak_kv_tokens": 5,
                     "log_rho_sum": pytest.approx(L(0.5) + L(1e-5)), "rho_min": pytest.approx(1e-5), "kept": False}
    assert second["log_rho_sum"] == pytest.approx(L(2.0)) and second["rho_min"] == pytest.approx(1.0)
    assert second["kept"] is True


def _document(dense_log_rho: float = 1e-6) -> dict:
    rows = [row_result("dense", CompressionConfig(), _batch([[dense_log_rho, 0.0, 0.0], [0.0, 0.0]])),
            row_result("rkv B=32", RKV, _batch([[0.0, L(0.5), L(1e-5)], [L(2.0), 0.0]]))]
    rows[0].stats["sparse/kl_k1"] = float("nan")  # NaN is written as null (strict JSON)
    meta = {"prompts": 1, "samples_per_prompt": 2, "sampler_seed": 1, "dense_tolerance": 1e-3,
            "correction": dataclasses.asdict(CorrectionConfig())}
    return results_document(Measurement(rows=rows, probe_max_abs_diff=2e-6, learner="tiny"), meta)


def test_results_document_histograms_share_edges_and_are_strict_json():
    doc = json.loads(json.dumps(_document(), allow_nan=False))
    assert doc["format_version"] == 1 and [r["label"] for r in doc["rows"]] == ["dense", "rkv B=32"]
    edges = doc["histogram_edges"]
    assert len(edges) == HISTOGRAM_BINS + 1
    assert edges[0] == pytest.approx(L(1e-5)) and edges[-1] == pytest.approx(L(2.0))
    assert [sum(r["histogram"]) for r in doc["rows"]] == [5, 5]
    assert doc["rows"][1]["histogram"][0] == 1 and doc["rows"][1]["histogram"][-1] == 1  # rho 1e-5 and rho 2
    assert doc["rows"][0]["stats"]["sparse/kl_k1"] is None
    assert doc["rows"][1]["compression"]["budget"] == 32 and doc["rows"][0]["compression"]["method"] == "none"


def test_table_has_a_row_per_setting_and_every_column():
    from rich.console import Console

    console = Console(width=400, record=True)
    console.print(build_table(_document()))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "KV cache" in line)
    assert all(h in header for h, _, _ in COLUMNS)
    rkv = next(line for line in lines if line.lstrip("│ ").startswith("rkv B=32"))
    cells = [c.strip() for c in rkv.split("│")[1:-1]]
    values = dict(zip(["KV cache", *(h for h, _, _ in COLUMNS)], cells))
    assert values["rho min"] == "1e-05" and values["vetoed seq"] == "0.500" and values["rejected tok"] == "0.800"
    assert values["contaminated seq"] == "0.500"  # sample 0 (rho 1e-5 < 0.5); sample 1's smallest rho is 1
    assert values["KV peak max"] == "5" and values["p50"] == "1"


def test_dense_check_says_whether_engine_and_learner_agree():
    ok, line = dense_check(_document(5e-6))  # mean over the dense row's 5 tokens: 1e-6
    assert ok and line.startswith("dense: mean |log rho| 1e-06 <= 0.001: the engine and the learner agree")
    ok, line = dense_check(_document(0.1))
    assert not ok and line.startswith("dense: mean |log rho| 0.02 > 0.001 (sync.probe_tolerance): the engine and "
                                      "the learner disagree even without compression")


def test_histogram_png(tmp_path):
    out = plot_histograms(_document(), tmp_path / "sub" / "study.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
