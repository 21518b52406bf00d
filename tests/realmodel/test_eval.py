"""``sparse-rl eval`` on SmolLM2-135M-Instruct and real GSM8K problems: dense and with R-KV on the hf engine (in this
process, as ``tests/e2e/test_eval_cli.py`` runs the command: torch and transformers are imported once for the tier).
SGLang's bf16 engine with the plugin evaluates the real model, dense and R-KV, in test_recipe.py's sglang run (the
trainer's evaluation samples with the same ``sample_problems`` as this command; one SGLang start for the tier)."""
from __future__ import annotations

import json

EVAL = ["--benchmarks", "gsm8k", "--limit", "2", "--max-new-tokens", "48", "--no-progress"]


def _results(out) -> dict:
    return json.loads(out.read_text())["benchmarks"]["gsm8k"]


def _eval_here(model, out, shared_data, *flags: str) -> dict:
    from sparse_rl_megatron.cli import main

    assert main(["eval", "--model", str(model), "--data-root", str(shared_data), *EVAL, "--output", str(out),
                 *flags]) == 0
    return _results(out)


def test_eval_dense_and_rkv(smollm2, shared_data, tmp_path):
    dense = _eval_here(smollm2, tmp_path / "dense.json", shared_data)
    rkv = _eval_here(smollm2, tmp_path / "rkv.json", shared_data, "--compression", "rkv", "--budget", "16",
                     "--buffer", "8")
    samples = {name: [p["samples"][0] for p in run["problems"]] for name, run in (("dense", dense), ("rkv", rkv))}
    assert len(samples["dense"]) == len(samples["rkv"]) == 2
    assert all(s["response"].strip() and s["compression_events"] == 0 for s in samples["dense"])
    assert all(s["compression_events"] > 0 for s in samples["rkv"])  # 16 kept of a ~100-token prompt + response
    # the real tokenizer round-trips: responses are text (words and numbers), not byte soup
    assert all(sum(c.isalpha() for c in s["response"]) > 20 for s in samples["dense"])
    assert [s["response"] for s in samples["dense"]] != [s["response"] for s in samples["rkv"]]

