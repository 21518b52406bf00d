"""The shortcut audit (tasks/audit.py): the mod-10 tasks fail it, the shortcut-free variants pass it."""
import math

import pytest

from sparse_rl_megatron.data.loader import Dataset
from sparse_rl_megatron.data.record import MathRecord
from sparse_rl_megatron.tasks import TASKS, get_task
from sparse_rl_megatron.tasks.audit import MARGIN, SE_FACTOR, audit_task
from sparse_rl_megatron.tasks.base import Task
from sparse_rl_megatron.tasks.modchain_problems import ChainFamily, Problem, answer_value, parse_prompt

KNOWN_SHORTCUTS = {"modchain", "modchain_weak"}
"""Tasks kept for history although they fail the audit (docs/embedded-default.md, "The shortcut")."""
SHORTCUT_FREE = ("modchain31_weak", "modchain31_wordbox_weak", "modchain100_weak")


@pytest.fixture(scope="module")
def audits():
    return {name: audit_task(get_task(name)) for name in TASKS.names()}


def score(audit, name, split):
    return next(s.accuracy[split] for s in audit.scores if s.name == name)


def test_the_mod10_tasks_fail_on_the_start_and_on_an_early_stop(audits):
    for name in KNOWN_SHORTCUTS:
        a = audits[name]
        assert not a.passed and a.chance == 0.1
        # every period of x <- a x + b mod 10 (a a unit) divides 20, so x_30 = x_10 on every problem
        assert score(a, "early stop: x_10", "heldout") == score(a, "early stop: x_10", "train") == 1.0
    # the figure of issue 26: boxing x0 is right on 248 of the 400 held-out records, 59% of the training ones
    weak = audits["modchain_weak"]
    assert score(weak, "prompt: the start x0", "heldout") == 248 / 400
    assert abs(score(weak, "prompt: the start x0", "train") - 0.59) < 0.005


@pytest.mark.parametrize("name", SHORTCUT_FREE)
def test_the_shortcut_free_variants_pass(audits, name):
    a = audits[name]
    assert a.passed, "\n".join(a.lines())
    for split in ("train", "heldout"):
        early = max(s.accuracy[split] for s in a.scores if s.name.startswith("early stop"))
        if name == "modchain100_weak":  # every orbit has period 100 > N: no early state is ever the answer
            assert early == score(a, "prompt: the start x0", split) == 0.0
        assert early <= a.limit(split) and score(a, "prompt: the start x0", split) <= a.limit(split)
    assert a.records["heldout"] == 400 and math.sqrt(0.25 / 400) <= 0.025  # worst-case binomial SE <= 2.5 points


def test_every_registered_task_is_audited_and_only_the_known_ones_fail(audits):
    # a new task with a shortcut, or a shortcut brought back into a variant, fails here
    assert {name for name, a in audits.items() if not a.passed} == KNOWN_SHORTCUTS


class _Planted(Task):
    """Answers that a trivial policy gets: ``copy`` the first prompt value, or a ``skew``ed answer distribution."""

    name = "planted"
    response_tokens = 8

    def __init__(self, mode: str):
        self.mode = mode

    def records(self, split, limit=None, seed=0):
        rows = []
        for i in range(400):
            x, y = i % 10, (i * 7 + 3) % 10
            answer = {"copy": x, "skew": 0 if i % 3 == 0 else (i * 3) % 10, "fair": (x + y + i // 10) % 10}[self.mode]
            rows.append(MathRecord(prompt=f"{x} {y}", answer=str(answer), source_id=f"{split}-{i}", dataset=self.name))
        return Dataset(name=self.name, path=f"planted/{split}", records=rows[:limit])

    def trivial_answers(self, record):
        return {"prompt: first": record.prompt.split()[0], "prompt: second": record.prompt.split()[1]}

    def build_model(self, out_dir, *, seed=0):
        raise NotImplementedError

    def warm_start(self, model_dir, out_dir, *, seed=0, should_stop=None, **options):
        raise NotImplementedError


def test_planted_shortcuts_are_caught_and_a_fair_task_passes():
    copy = audit_task(_Planted("copy"))
    assert not copy.passed and copy.best("heldout").name == "prompt: first"
    skew = audit_task(_Planted("skew"))  # answer 0 on a third of the records and more: a constant finds it
    assert not skew.passed and skew.best("heldout").name.startswith("constant:")
    fair = audit_task(_Planted("fair"))
    assert fair.passed, "\n".join(fair.lines())
    # the limit: chance + max(5 points, 4 binomial standard errors of a chance-level policy)
    n = fair.records["heldout"]
    assert fair.limit("heldout") == pytest.approx(0.1 + max(MARGIN, SE_FACTOR * math.sqrt(0.1 * 0.9 / n)))


@pytest.mark.parametrize("name", ("modchain_weak", *SHORTCUT_FREE))
def test_records_flag_the_answers_named_in_the_prompt(name):
    task = get_task(name)
    held = task.records("heldout")
    for r in held:
        last = task.spec.family.problem((r.extra["x0"], r.extra["a"], r.extra["b"])).states(task.spec.steps)[-1]
        assert r.answer == answer_value(last, task.spec.answer_format)  # digits, or the state's word
        assert r.extra["shortcut_free"] == all(v != last for _, v in parse_prompt(r.prompt))
    if name == "modchain_weak":  # issue 26: 83 held-out records whose answer is none of the prompt's values
        assert sum(r.extra["shortcut_free"] for r in held) == 83


@pytest.mark.parametrize("name", SHORTCUT_FREE)
def test_shortcut_free_variants_tokenize_and_bound_their_responses(name):
    task = get_task(name)
    tok = task.tokenizer()
    lengths = []
    for r in task.records("heldout", limit=50):
        assert len(tok(r.prompt, add_special_tokens=False)["input_ids"]) == task.prompt_tokens
        ids = tok(f"{r.prompt} {r.extra['solution']}", add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == f"{r.prompt} {r.extra['solution']}"
        lengths.append(len(ids) - task.prompt_tokens + 1)  # + EOS
    assert max(lengths) <= task.response_tokens
    # a two-digit answer: \boxed { d d } after 2N words (2 more for sZero <x0>), then EOS
    assert 2 * (task.spec.steps + task.spec.restate_start) + 6 in lengths


def test_modchain31_weak_responses_restate_the_start_so_each_step_adds_one_prompt_value():
    """Without ``sZero <x0>`` the first state needs x0 and a from the prompt at once: seed 2's warm start got it
    wrong on 352 of 400 held-out chains (and no later step), docs/embedded-default.md."""
    from sparse_rl_megatron.tasks.modchain_problems import digit_word

    task = get_task("modchain31_weak")
    assert task.spec.restate_start and task.response_tokens == 67
    tok = task.tokenizer()
    assert len(tok(" sZero", add_special_tokens=False)["input_ids"]) == 1
    stopped = 0
    for r in task.records("train", limit=200):
        start = f"sZero {digit_word(r.extra['x0'])} sOne {digit_word((r.extra['x0'] + r.extra['a']) % 31)} "
        assert r.extra["solution"].startswith(start) and r.extra["demonstration"].startswith(start)
        stopped += r.extra["demonstration"] != r.extra["solution"]
        words = r.extra["demonstration"].split()  # sZero x0, 29 steps and \boxed{x}, or 26 steps and no answer
        assert (words[-1].startswith("\\boxed{") and len(words) == 2 * 30 + 1) or len(words) == 2 * 27
    assert stopped > 0  # the weak teacher still stops early (after sTwentySix)
    p = Problem(4, 3, 20, modulus=31, rule="alternating")
    assert p.solution(2, restate_start=True) == "sZero four sOne seven sTwo twentyseven \\boxed{27}"
    assert p.solution(2) == "sOne seven sTwo twentyseven \\boxed{27}"
    assert "sZero" not in get_task("modchain100_weak").tokenizer().get_vocab()  # other variants keep their format


def test_chain_family_validation_and_mod31_format():
    p = Problem(4, 3, 20, modulus=31)
    assert p.states(3) == [1, 23, 27]
    assert p.solution(2) == "sOne one sTwo twentythree \\boxed{23}"
    assert parse_prompt(p.prompt()) == [("x", 4), ("a", 3), ("b", 20)]
    family = ChainFamily(modulus=31, multipliers=(3,), skip_fixed_points=True)
    assert len(family.keys()) == 30 * 31  # one fixed point per (a, b) left out
    # alternating: x + a on odd steps, x + b on even ones (a need not be a unit)
    alt = ChainFamily(modulus=31, rule="alternating", multipliers=(3,), offsets=(20,))
    assert alt.problem((4, 3, 20)).states(3) == [7, 27, 30] and len(alt.keys()) == 31
    assert ChainFamily(modulus=10, rule="alternating", multipliers=(2,)).multipliers == (2,)
    with pytest.raises(ValueError, match="rule must be one of affine, alternating"):
        ChainFamily(rule="square")
    with pytest.raises(ValueError, match="units mod 10"):
        ChainFamily(multipliers=(2,))
    with pytest.raises(ValueError, match="modulus must be in"):
        ChainFamily(modulus=101)


def test_cli_prints_the_verdicts_and_exits_1_on_a_failing_task(capsys):
    from sparse_rl_megatron.cli import main

    assert main(["audit", "task:modchain31_weak"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("task:modchain31_weak: PASS") and "prompt: " in out and "early stop: " in out
    assert main(["audit", "modchain_weak"]) == 1
    out = capsys.readouterr().out
    assert "task:modchain_weak: FAIL" in out and "early stop: x_10                 1.000" in out
    assert main(["audit", "nosuchtask"]) == 2
    assert "unknown task 'nosuchtask'" in capsys.readouterr().err


def test_shortcut_free_accuracy_from_an_evaluation_section():
    from sparse_rl_megatron.eval.subsets import shortcut_free_metrics

    held = get_task("modchain_weak").records("heldout", limit=16)
    ds = Dataset(name="x", path="x", records=held)
    # a policy that boxes x0: right exactly where the answer is the start, so 0 on the shortcut-free records
    section = {"problems": [{"correct": int(r.answer == str(r.extra["x0"])), "samples": [{}]} for r in held]}
    free = [r for r in held if r.extra["shortcut_free"]]
    m = shortcut_free_metrics("eval/dense/x", ds, section)
    assert m == {"eval/dense/x/shortcut_free_accuracy": 0.0, "eval/dense/x/shortcut_free_problems": len(free)}
    assert sum(p["correct"] for p in section["problems"]) > 0  # while the overall accuracy is not 0
    # two samples each, one right on every flagged record: mean share 0.5
    section = {"problems": [{"correct": 1, "samples": [{}, {}]} for _ in held]}
    assert shortcut_free_metrics("p", ds, section)["p/shortcut_free_accuracy"] == 0.5
    plain = Dataset(name="y", path="y", records=[MathRecord(prompt="q", answer="1", source_id="s", dataset="y")])
    assert shortcut_free_metrics("p", plain, {"problems": [{"correct": 1, "samples": [{}]}]}) == {}
    with pytest.raises(ValueError, match="3 evaluated problems for 16 records"):
        shortcut_free_metrics("p", ds, {"problems": section["problems"][:3]})


def test_the_default_recipe_is_on_the_shortcut_free_task_and_its_cache_binds():
    """``cpu_default.yaml`` trains ``modchain31_wordbox_weak`` (which passes the audit) with a KV budget of at most a
    quarter of the response; ``cpu_modchain31.yaml`` is it at B = 16; ``cpu_modchain10_weak.yaml`` is the
    default before issue 26, on the task with the shortcut."""
    from pathlib import Path

    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.utils.config_io import load_config, to_dict

    configs = Path(__file__).resolve().parents[2] / "configs"
    default, b16, old = (to_dict(load_config(TrainConfig, configs / f))
                         for f in ("cpu_default.yaml", "cpu_modchain31.yaml", "cpu_modchain10_weak.yaml"))
    assert default["model_path"] == default["data"]["dataset"] == "task:modchain31_wordbox_weak"
    task = get_task(default["model_path"])
    assert default["warm_start"] == {} and task.spec.warm_start_steps == 1000  # the task's own warm start
    assert audit_task(task).passed and len(task.records("heldout")) >= 400  # SE <= 0.5 / sqrt(400) = 2.5 points
    budget = default["rollout"]["compression"]["budget"]
    assert budget <= task.response_tokens / 4 and task.response_tokens <= default["rollout"]["sampling"]["max_new_tokens"]
    assert {k for k in default if default[k] != b16[k]} == {"run_dir", "rollout", "expect"}  # b16: no documented result
    assert b16["rollout"]["compression"]["budget"] == 16
    assert old["model_path"] == old["data"]["dataset"] == "task:modchain_weak" and old["warm_start"] == {}
    # and issue 38's Dr. GRPO advantages and KL to the warm start (the old recipe keeps GRPO and no KL)
    assert {k for k in default if default[k] != old[k]} == {"run_dir", "model_path", "data", "rollout", "expect",
                                                             "correction", "learner"}



def test_sparse_rl_eval_reports_the_shortcut_free_accuracy():
    """``sparse-rl eval``'s results file and tables (and its comparison of two files) carry the shortcut-free
    accuracy of a task that flags its records, and nothing of the kind for a data set without the flag."""
    from rich.console import Console

    from sparse_rl_megatron.eval.config import EvalConfig
    from sparse_rl_megatron.eval.report import print_comparison, print_results
    from sparse_rl_megatron.eval.runner import benchmark_section

    held = get_task("modchain_weak").records("heldout", limit=16)
    free = sum(r.extra["shortcut_free"] for r in held)
    assert 0 < free < len(held)

    def sample(right: bool, response: str = "") -> dict:
        return {"reason": "correct" if right else "wrong", "response_tokens": 66, "finish_reason": "stop",
                "compression_events": 12, "peak_kv_tokens": 29, "response": response}

    def results(problems, records) -> dict:
        ds = Dataset(name="x", path="x", records=records)
        section = benchmark_section("x", ds, problems, EvalConfig(model="m", benchmarks=["x"]), {"generate": 1.0,
                                                                                                   "verify": 0.0})
        return {"meta": {"model": "m", "engine": "hf", "mode": "dense", "temperature": 0.0, "top_p": 1.0,
                         "template": "raw"}, "benchmarks": {"x": section}}

    # the x0 policy: right exactly where the answer is the start, never on a shortcut-free record
    copy = results([{"source_id": r.source_id, "samples": [sample(r.answer == str(r.extra["x0"]),
                                                                  f" \\boxed{{{r.extra['x0']}}}")]} for r in held], held)
    m = copy["benchmarks"]["x"]["metrics"]
    assert m["shortcut_free_accuracy"] == 0.0 and m["shortcut_free_problems"] == free and m["avg@1"] > 0
    assert m["full_chain_frac"] == 0.0  # no chain written at all
    solved = results([{"source_id": r.source_id, "samples": [sample(True, " " + r.extra["solution"])]} for r in held],
                     held)
    assert solved["benchmarks"]["x"]["metrics"]["full_chain_frac"] == 1.0
    console = Console(record=True, width=200)
    print_results(copy, console)
    print_comparison(copy, solved, console=console)
    text = console.export_text()
    assert f"shortcut-free avg@1 ({free} problems)" in text and "shortcut-free %" in text
    assert "0.00 |" in text.replace("│", "|") and "+100.00" in text and "fully correct chains %" in text
    plain = [MathRecord(prompt="q", answer="1", source_id="s", dataset="y")]
    m = results([{"source_id": "s", "samples": [sample(True)]}], plain)["benchmarks"]["x"]["metrics"]
    assert "shortcut_free_accuracy" not in m and "full_chain_frac" not in m


def test_sparse_rl_eval_takes_a_tasks_heldout_split(tmp_path):
    """``--benchmarks task:<name>``: the held-out records the trainer evaluates (seed 0), flags included; an unknown
    task is refused before anything loads, naming the valid ones."""
    import json

    from sparse_rl_megatron.eval.cli import check_inputs
    from sparse_rl_megatron.eval.config import EvalConfig
    from sparse_rl_megatron.eval.runner import load_benchmark
    from sparse_rl_megatron.utils.errors import UsageError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # only looked at, never loaded here
    config = EvalConfig(model=str(tmp_path), benchmarks=["task:modchain31_weak"], limit=16, template="raw")
    check_inputs(config, None)
    ds = load_benchmark("task:modchain31_weak", config)
    expected = get_task("modchain31_weak").records("heldout", limit=16, seed=0)
    assert [r.prompt for r in ds] == [r.prompt for r in expected] and len(ds) == 16
    assert sum(r.extra["shortcut_free"] for r in ds) == 13  # as in the embedded-default e2e test
    with pytest.raises(UsageError, match="nosuchtask"):
        check_inputs(EvalConfig(model=str(tmp_path), benchmarks=["task:nosuchtask"], template="raw"), None)
