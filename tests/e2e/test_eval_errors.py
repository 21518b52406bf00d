"""`sparse-rl eval` refuses a bad command line argparse-style (usage line, one error line naming the option or
file, exit status 2, no traceback) before it loads any model, and writes nothing."""
import json
import re

from sparse_rl_megatron.cli import main


def eval_error(capsys, *argv) -> str:
    """Run `sparse-rl eval ARGV`, check it failed as a usage error, and return its error line."""
    try:
        rc = main(["eval", *map(str, argv)])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage: sparse-rl eval"), err
    assert lines[-1].startswith("sparse-rl eval: error: "), err
    assert "Traceback" not in err
    return lines[-1].removeprefix("sparse-rl eval: error: ")


def test_option_errors_are_usage_errors(tiny_model, shared_data, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default-named results file would land here
    common = ["--data-root", shared_data]
    assert eval_error(capsys).startswith("--model is required")
    assert eval_error(capsys, "--model", tmp_path / "missing", *common) == f"--model: {tmp_path / 'missing'} does not exist"
    msg = eval_error(capsys, "--model", tiny_model, "--benchmarks", "gsm8k,gsm9k", *common)
    assert msg.startswith("--benchmarks: 'gsm9k' is neither a named data set (valid names: aime24, amc23,")
    assert eval_error(capsys, "--model", tiny_model, "--benchmarks", tmp_path / "mine.jsonl", *common) == (
        f"--benchmarks: data file not found: {tmp_path / 'mine.jsonl'}")
    assert "point the data root at the shared data folder with --data-root" in eval_error(
        capsys, "--model", tiny_model, "--benchmarks", "gsm8k", "--data-root", tmp_path)
    assert eval_error(capsys, "--model", tiny_model, "--limit", "0") == "argument --limit: must be an integer >= 1, got '0'"
    assert eval_error(capsys, "--model", tiny_model, "--top-p", "2", *common) == "--top-p must be in (0, 1], got 2.0"
    assert eval_error(capsys, "--model", tiny_model, "--compression", "rkvv", *common).startswith(
        "--compression: unknown KV compression method 'rkvv'; valid names: h2o, none, rkv")
    assert eval_error(capsys, "--model", tiny_model, "--engine", "vllm", *common) == (
        "--engine: unknown rollout engine 'vllm'; valid names: hf, sglang")
    assert eval_error(capsys, "--model", tiny_model, "--pass-k", "1,x", *common).startswith("--pass-k '1,x'")
    assert eval_error(capsys, "--model", tiny_model, "--bench", "aime24:k=4", *common).startswith("--bench 'aime24:k=4'")
    assert eval_error(capsys, "--model", tiny_model, "--benchmarks", "math500", "--bench", "gsm8k:n=2", *common) == (
        "--bench names gsm8k, which are not among the benchmarks being evaluated (math500)")
    assert eval_error(capsys, "--model", tiny_model, "--output", tmp_path, *common) == (
        f"--output: {tmp_path} is a directory; give the results file's path")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_compare_refuses_bad_files(tmp_path, capsys):
    not_results, broken = tmp_path / "config.json", tmp_path / "broken.json"
    not_results.write_text(json.dumps({"hello": 1}))
    broken.write_text('{"format_version": 1,\n')
    assert eval_error(capsys, "--compare", not_results, not_results) == (
        f"--compare: {not_results}: expected format_version 1 of a `sparse-rl eval` results file, got None")
    assert eval_error(capsys, "--compare", broken, not_results).startswith(f"--compare: {broken} is not valid JSON (")
    assert eval_error(capsys, "--compare", tmp_path / "a.json", not_results) == (
        f"--compare: results file {tmp_path / 'a.json'} does not exist")


def test_compression_options_need_a_compressor(tiny_model, shared_data, capsys):
    msg = eval_error(capsys, "--model", tiny_model, "--data-root", shared_data, "--budget", "64")
    assert msg.startswith("--budget without --compression would run dense (the full KV cache); add --compression rkv")
    msg = eval_error(capsys, "--model", tiny_model, "--compression", "none", "--buffer", "8", "--scope", "response")
    assert msg.startswith("--buffer, --scope without --compression would run dense")


def test_prompt_and_new_tokens_must_fit_the_context(tiny_model, shared_data, capsys):
    # the paper preset asks 8192 new tokens; the tiny model's context is 8192 (as Qwen2.5-Math's 4096 would be
    # too small): refused with the value that fits, before the model loads (the engine's own check says otherwise)
    msg = eval_error(capsys, "--model", tiny_model, "--data-root", shared_data, "--benchmarks", "gsm8k,math500",
                     "--limit", "3")
    m = re.fullmatch(r"(\w+): the longest prompt \((\d+) tokens\) \+ 8192 new tokens exceed the model's context of "
                     r"8192 tokens \(max_position_embeddings\); lower --max-new-tokens to (\d+) or less \(or for this "
                     r"benchmark alone: --bench (\w+):max_new_tokens=(\d+)\); (\w+) overflow too", msg)
    assert m, msg
    name, prompt, room, name2, room2, other = m.groups()
    assert int(room) == int(room2) == 8192 - int(prompt) and name == name2 and {name, other} == {"gsm8k", "math500"}
