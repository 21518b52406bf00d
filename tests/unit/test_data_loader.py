"""Dataset loading: the field mapping of each shared file, malformed rows, empty files, user files."""
import json
import logging
import shutil

import pytest

from sparse_rl_megatron.data import (
    DATASETS, EmptyDatasetError, data_root, dataset_path, load_dataset,
)
from sparse_rl_megatron.utils.registry import UnknownNameError

# name -> (usable rows, skipped rows, first record: prompt start, answer, source id, answer style, extra keys)
EXPECTED = {
    "gsm8k": (1319, 0, "Janet\u2019s ducks lay 16 eggs", "18", "0", "boxed_or_number", {"solution"}),
    "math500": (500, 0, "Convert the point $(0,3)$", r"\left( 3, \frac{\pi}{2} \right)",
                "test/precalculus/807.json", "boxed", {"solution", "subject", "level"}),
    "minerva_math": (272, 0, "Each of the two Magellan telescopes", "1.6", "0", "boxed", {"solution", "type"}),
    "gaokao2023en": (383, 2, "Given sets $M=", r"\{x|-2\leq x < 1\}", "L1", "boxed", {"source"}),
    "olympiadbench": (675, 0, "Xenia and Sergey play the following game", "2", "1606", "boxed",
                      {"answer_type", "is_multiple_answer", "subfield"}),
    "aime24": (30, 0, "Every morning Aya goes for a $9$-kilometer-long walk", "204", "60", "boxed",
               {"solution", "url"}),
    "amc23": (40, 0, "Cities $A$ and $B$ are $45$ miles apart", "27", "0", "boxed", {"url"}),
    "math_train": (7498, 2, "Let \\[f(x) = \\left\\{", "0", "L1", "boxed", {"solution", "level", "type"}),
    "math_train_l3to5": (5584, 2, "Let \\[f(x) = \\left\\{", "0", "L1", "boxed", {"solution", "level", "type"}),
    "gsm8k_train": (7473, 0, "Natalia sold clips to 48", "72", "0", "boxed_or_number", {"solution"}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_field_mapping_of_each_shared_file(name, shared_data):
    rows, skipped, prompt_start, answer, source_id, style, extra_keys = EXPECTED[name]
    ds = load_dataset(name, root=shared_data)
    assert (len(ds), len(ds.skipped)) == (rows, skipped)
    first = ds[0]
    assert first.prompt.startswith(prompt_start)
    assert (first.answer, first.source_id, first.answer_style, first.dataset) == (answer, source_id, style, name)
    assert set(first.extra) == extra_keys
    assert all(r.prompt and r.answer for r in ds)
    assert len({r.source_id for r in ds}) == len(ds)  # ids are unique within a set (results are keyed by them)


def test_every_named_set_is_covered():
    assert set(DATASETS.names()) == set(EXPECTED)


def test_specific_gold_mappings(shared_data):
    ob = load_dataset("olympiadbench", root=shared_data)
    by_id = {r.source_id: r for r in ob}
    assert by_id[str(json.loads((shared_data / "eval/olympiadbench/test.jsonl").read_text().splitlines()[194])["id"])
                 ].answer == "221,8"  # published as "$221,$8$": delimiters dropped
    math = load_dataset("math_train_l3to5", root=shared_data)
    assert {r.extra["level"] for r in math} == {"Level 3", "Level 4", "Level 5"}
    assert math.filtered == 7500 - 5586  # levels 1-2 and "Level ?" are filtered, not malformed
    gsm = load_dataset("gsm8k", root=shared_data)
    assert gsm[0].extra["solution"].endswith("#### 18")


def test_real_malformed_rows_are_reported_with_file_and_line(shared_data, caplog):
    with caplog.at_level(logging.WARNING, logger="sparse_rl_megatron.data.loader"):
        ds = load_dataset("gaokao2023en", root=shared_data)
    assert [(s.line, s.reason) for s in ds.skipped] == [(168, "field 'answer' is empty"),
                                                        (193, "field 'answer' is empty")]
    assert "gaokao2023en/test.jsonl:168: skipped malformed row" in caplog.text
    assert [s.line for s in load_dataset("math_train", root=shared_data).skipped] == [5342, 5344]  # \boxed{}


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_malformed_rows_are_skipped_and_counted(tmp_path, caplog):
    path = _write(tmp_path / "mine.jsonl", [
        json.dumps({"q": "What is 1+1?", "a": "2", "uid": "p1"}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"q": "no label here"}),
        "",
        json.dumps({"q": "empty label", "a": "  "}),
        json.dumps({"q": "What is 2+2?", "a": 4.0}),
        json.dumps({"q": {"nested": 1}, "a": "3"}),
    ])
    with caplog.at_level(logging.WARNING, logger="sparse_rl_megatron.data.loader"):
        ds = load_dataset(path, input_key="q", label_key="a", id_key="uid")
    assert [(r.prompt, r.answer, r.source_id) for r in ds] == [("What is 1+1?", "2", "p1"), ("What is 2+2?", "4", "L7")]
    assert [s.line for s in ds.skipped] == [2, 3, 4, 6, 8]
    assert "invalid JSON" in ds.skipped[0].reason
    assert "missing field 'a'" in ds.skipped[2].reason
    assert f"{path}:2: skipped malformed row" in caplog.text
    assert "skipped 5 malformed row(s), kept 2" in caplog.text


def test_file_without_usable_rows_is_an_error(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", ["{oops", json.dumps({"question": "no answer"})])
    with pytest.raises(EmptyDatasetError, match=r"no usable rows \(2 malformed.*line 1"):
        load_dataset(bad, input_key="question", label_key="answer")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(EmptyDatasetError, match="no usable rows"):
        load_dataset(empty)


def test_user_jsonl_with_input_and_label_keys(tmp_path):
    path = _write(tmp_path / "train.jsonl", [
        json.dumps({"input": "Compute 6*7.", "label": "$42$", "topic": "arith"}),
        json.dumps({"input": "Half of 1?", "label": r"\frac{1}{2}"}),
    ])
    ds = load_dataset(path, input_key="input", label_key="label")
    assert [(r.prompt, r.answer, r.source_id, r.answer_style) for r in ds] == [
        ("Compute 6*7.", "42", "L1", "boxed"), ("Half of 1?", r"\frac{1}{2}", "L2", "boxed")]
    assert ds[0].extra == {"topic": "arith"}
    assert ds[0].dataset == f"{tmp_path.name}_train"  # a generic file name gets its folder's name
    sol = _write(tmp_path / "sol.jsonl", [json.dumps({"p": "x?", "s": r"so \boxed{7}."}),
                                          json.dumps({"p": "y?", "s": "1 + 2 = 3\n#### 3"})])
    assert [r.answer for r in load_dataset(sol, input_key="p", label_key="s", label_is_solution=True,
                                           answer_style="boxed_or_number")] == ["7", "3"]
    assert load_dataset(sol, input_key="p", label_key="s", limit=1).records[0].prompt == "x?"


def test_user_copy_of_a_published_file_with_format(tmp_path, shared_data):
    copy = tmp_path / "my_aime.jsonl"
    shutil.copy(shared_data / "eval/aime24/test.jsonl", copy)
    ds = load_dataset(copy, format="aime")
    assert len(ds) == 30 and ds[0].answer == "204"
    with pytest.raises(UnknownNameError, match="gsm8k"):
        load_dataset(copy, format="aime25")


def test_parquet_user_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["1+1?", ""], "answer": ["2", "3"]}), path)
    ds = load_dataset(path)
    assert [(r.prompt, r.answer) for r in ds] == [("1+1?", "2")] and [s.line for s in ds.skipped] == [2]


def test_names_roots_and_errors(tmp_path, monkeypatch, shared_data):
    with pytest.raises(ValueError, match="valid names: aime24, amc23"):
        load_dataset("gsm8k_test")
    with pytest.raises(FileNotFoundError, match="SPARSE_RL_DATA"):
        dataset_path("math500", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load_dataset(tmp_path / "missing.jsonl")
    # The environment variable moves the default root; an explicit root wins over it.
    (tmp_path / "eval" / "amc23").mkdir(parents=True)
    shutil.copy(shared_data / "eval/amc23/test.jsonl", tmp_path / "eval/amc23/test.jsonl")
    monkeypatch.setenv("SPARSE_RL_DATA", str(tmp_path))
    assert data_root() == tmp_path
    assert len(load_dataset("amc23")) == 40
    assert data_root(shared_data) == shared_data
    monkeypatch.delenv("SPARSE_RL_DATA")
    assert data_root().parts[-2:] == ("shared", "data")
