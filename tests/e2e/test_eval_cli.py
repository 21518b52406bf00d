"""`sparse-rl eval` end to end on a tiny random model: 5 problems of each of the seven benchmarks,
dense and compressed-KV, the results JSON, and the side-by-side comparison of two results files."""
import json

import pytest

from sparse_rl_megatron.cli import main
from sparse_rl_megatron.data import BENCHMARKS, load_dataset
from sparse_rl_megatron.rewards import REASONS, check_answer

LIMIT, N, TOKENS = 5, 2, 24


def _eval(model, shared_data, out, *extra):
    return main(["eval", "--model", str(model), "--data-root", str(shared_data), "--limit", str(LIMIT),
                 "--n", str(N), "--max-new-tokens", str(TOKENS), "--no-progress", "--verifier-timeout", "10",
                 "--output", str(out), *extra])


@pytest.mark.timeout(300)
def test_eval_dense_sparse_and_compare(tiny_model, shared_data, tmp_path, capsys):
    dense_path, sparse_path = tmp_path / "dense.json", tmp_path / "sparse.json"
    assert _eval(tiny_model, shared_data, dense_path) == 0
    printed = capsys.readouterr().out
    dense = json.loads(dense_path.read_text())
    assert list(dense["benchmarks"]) == list(BENCHMARKS)
    assert dense["meta"]["mode"] == "dense" and dense["meta"]["temperature"] == 0.8
    for name, bench in dense["benchmarks"].items():
        assert f"{name}: {LIMIT} problems x n={N}" in printed  # a table per benchmark
        records = load_dataset(name, root=shared_data, limit=LIMIT)
        assert [p["source_id"] for p in bench["problems"]] == [r.source_id for r in records]
        assert [p["gold"] for p in bench["problems"]] == [r.answer for r in records]
        m = bench["metrics"]
        assert (m["problems"], m["samples"], bench["n"]) == (LIMIT, LIMIT * N, N)
        assert sum(m["reasons"].values()) == LIMIT * N
        assert set(m) >= {f"avg@{N}", "pass@1", f"pass@{N}"}
        for p in bench["problems"]:
            assert [s["index"] for s in p["samples"]] == list(range(N))
            assert p["correct"] == sum(s["reason"] == "correct" for s in p["samples"])
            for s in p["samples"]:
                assert s["reason"] in REASONS and 1 <= s["response_tokens"] <= TOKENS
                assert s["compression_events"] == 0
                # The stored verdict is the verifier's verdict on the stored response.
                assert check_answer(s["response"], p["gold"], p["answer_style"]).reason == s["reason"]
        correct = [[s["reason"] == "correct" for s in p["samples"]] for p in bench["problems"]]
        assert m[f"avg@{N}"] == pytest.approx(sum(sum(c) / N for c in correct) / LIMIT)

    # Compressed-KV inference of the same model on two benchmarks and a user file.
    user = tmp_path / "mine.jsonl"
    user.write_text("\n".join(json.dumps({"q": f"What is {i} + {i}?", "a": str(2 * i)}) for i in range(3)) + "\n")
    assert _eval(tiny_model, shared_data, sparse_path, "--benchmarks", f"gsm8k,math500,{user}", "--input-key", "q",
                 "--label-key", "a", "--compression", "rkv", "--budget", "32", "--window", "4", "--buffer", "8") == 0
    sparse = json.loads(sparse_path.read_text())
    assert sparse["meta"]["mode"] == "rkv-B32-W8" and sparse["meta"]["compression"]["budget"] == 32
    assert list(sparse["benchmarks"]) == ["gsm8k", "math500", str(user)]
    assert [p["gold"] for p in sparse["benchmarks"][str(user)]["problems"]] == ["0", "2", "4"]
    assert all(s["compression_events"] > 0 for b in sparse["benchmarks"].values() for p in b["problems"]
               for s in p["samples"])
    capsys.readouterr()

    assert main(["eval", "--compare", str(dense_path), str(sparse_path)]) == 0
    out = capsys.readouterr().out
    assert "dense = " in out and "(rkv-B32-W8)" in out
    assert "gsm8k: dense n=2 vs sparse n=2" in out and "math500: dense n=2 vs sparse n=2" in out
    assert "sparse - dense" in out and "compression events / sample" in out
    assert "not compared" in out and "aime24" in out  # benchmarks only the dense file has


def test_mode_label_sampling_header_and_a_compressor_that_never_runs(tiny_model, shared_data, tmp_path, capsys,
                                                                     caplog):
    out = tmp_path / "greedy.json"
    assert main(["eval", "--model", str(tiny_model), "--data-root", str(shared_data), "--benchmarks", "gsm8k",
                 "--limit", "2", "--max-new-tokens", "8", "--temperature", "0", "--compression", "rkv",
                 "--no-progress", "--verifier-workers", "1", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    header = " ".join(printed.split("gsm8k:")[0].split())  # before the first table; rich wraps long lines
    assert "mode=rkv-B512-W128" in header and "greedy" in header and "top-p" not in printed
    # prompt + 8 tokens stays far below B + W = 640: the "compressed" run is a dense one, and says so
    assert "gsm8k: KV compression never runs for 2 of 2 prompts: prompt + 8 new tokens stays below B + W = 640 " \
           "(budget 512 + buffer 128, scope all), so every sample decodes on the full KV cache" in caplog.text
    results = json.loads(out.read_text())
    assert results["meta"]["mode"] == "rkv-B512-W128"
    assert all(s["compression_events"] == 0 for p in results["benchmarks"]["gsm8k"]["problems"] for s in p["samples"])


def test_default_results_name_never_replaces_earlier_results(tiny_model, shared_data, tmp_path, monkeypatch):
    from sparse_rl_megatron.eval.results import default_results_name

    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / default_results_name(tiny_model, "dense")
    assert earlier.name == f"eval-{tiny_model.parent.name}_model-dense.json"
    earlier.write_text("an earlier run's results")
    assert main(["eval", "--model", str(tiny_model), "--data-root", str(shared_data), "--benchmarks", "gsm8k",
                 "--limit", "1", "--max-new-tokens", "4", "--no-progress", "--verifier-workers", "1"]) == 0
    assert earlier.read_text() == "an earlier run's results"
    assert json.loads((tmp_path / earlier.name.replace(".json", "-2.json")).read_text())["meta"]["mode"] == "dense"
