"""task:modchain_weak: the weaker teacher's demonstrations, the classes, and per-class evaluation metrics."""
import random

import pytest

from sparse_rl_megatron.tasks import get_task
from sparse_rl_megatron.tasks.modchain import ModChainSpec, ModChainTask
from sparse_rl_megatron.tasks.modchain_problems import Problem, all_keys
from sparse_rl_megatron.tasks.modchain_teacher import EarlyStopTeacher


@pytest.fixture(scope="module")
def task():
    return get_task("task:modchain_weak")


def test_the_class_and_its_early_answers():
    # odd b: (a - 1) x0 is even, so a x0 + b = x0 (mod 10) has no solution: no fixed point, and no orbit of
    # period dividing 3 either; every early answer x_27 differs from the gold x_30
    odd_b = EarlyStopTeacher(subset="odd_b")
    assert sum(odd_b.in_class(Problem(*k), 30) for k in all_keys()) == 200
    odd_b.check_early_answers_wrong(30)
    # the default class: x_27 odd and not a chain where x_27 == x_30 (20 such problems have an odd x_27)
    t = EarlyStopTeacher()
    members = [k for k in all_keys() if t.in_class(Problem(*k), 30)]
    assert len(members) == 180
    assert all(Problem(*k).states(30)[26] % 2 == 1 != (Problem(*k).states(30)[26] == Problem(*k).states(30)[29])
               for k in members)
    t.check_early_answers_wrong(30)
    with pytest.raises(ValueError, match="stop_step=30 must be below the chain length 30"):
        ModChainSpec(teacher=EarlyStopTeacher(stop_step=30))


def test_a_teacher_whose_early_answers_can_be_right_is_refused(monkeypatch):
    from sparse_rl_megatron.tasks import modchain_teacher as T

    monkeypatch.setitem(T.SUBSETS._items, "odd_x0", lambda p, n, k: p.x0 % 2 == 1)  # includes fixed points
    with pytest.raises(ValueError, match=r"x_27 == x_30 on \d+ problems of 'odd_x0'"):
        EarlyStopTeacher(subset="odd_x0").check_early_answers_wrong(30)


def test_demonstrations_stop_early_on_the_class_only(task):
    train = task.records("train")
    cls = [r for r in train if r.extra["subset"] == "odd_x_stop"]
    rest = [r for r in train if r.extra["subset"] == "rest"]
    assert len(cls) + len(rest) == len(train) and cls and rest
    assert all(r.extra["demonstration"] == r.extra["solution"] for r in rest)
    early = [r for r in cls if r.extra["demonstration"] != r.extra["solution"]]
    assert abs(len(early) / len(cls) - 0.7) < 3 * (0.21 / len(cls)) ** 0.5  # binomial, 3 standard errors
    for r in early[:50]:
        p = Problem(r.extra["x0"], r.extra["a"], r.extra["b"])
        x27 = p.states(27)[-1]
        assert x27 % 2 == 1
        assert r.extra["demonstration"] == " ".join(p.solution(30).split()[:54] + [f"\\boxed{{{x27}}}"])
        assert r.answer == p.answer(30) != str(x27)  # the gold answer stays x_30; the early one is wrong
    # the draws are fixed by the seed; the held-out split keeps its gold solutions and names its classes
    assert [r.extra["demonstration"] for r in task.records("train")] == [r.extra["demonstration"] for r in train]
    other = task.records("train", seed=1)
    assert [r.extra["demonstration"] for r in other] != [r.extra["demonstration"] for r in train]
    held = task.records("heldout")
    assert sum(r.extra["subset"] == "odd_x_stop" for r in held) == 144  # 36 held-out problems x 4 variants


def test_sft_examples_are_the_demonstrations(task):
    tok = task.tokenizer()
    examples = task.sft_examples(tok)
    train = task.records("train")
    lengths = {len(resp) for _, resp in examples}
    assert lengths == {60, 66}  # 2 x 27 words + 5 answer tokens + EOS; 2 x 30 + 5 + EOS
    for (prompt, resp), r in list(zip(examples, train))[:30]:
        assert tok.decode(resp[:-1]) .strip() == r.extra["demonstration"] and resp[-1] == tok.eos_token_id
    # the perfect task is unchanged: no subset, demonstrations are the solutions
    plain = get_task("task:modchain").records("train", limit=5)
    assert all("subset" not in r.extra and "demonstration" not in r.extra for r in plain)


def test_bad_teacher_options_name_their_field():
    with pytest.raises(ValueError, match="EarlyStopTeacher.subset: unknown modchain subset 'odd'; valid names: odd_b, "
                                         "odd_x_stop"):
        EarlyStopTeacher(subset="odd")
    with pytest.raises(ValueError, match=r"EarlyStopTeacher.stop_prob must be in \[0, 1\]"):
        EarlyStopTeacher(stop_prob=1.5)
    with pytest.raises(ValueError, match="EarlyStopTeacher.stop_step must be >= 1"):
        EarlyStopTeacher(stop_step=0)
    t = EarlyStopTeacher(stop_prob=1.0, subset="odd_b")
    assert t.subset_of(Problem(0, 1, 3), 30) == "odd_b" and t.subset_of(Problem(0, 1, 2), 30) == "rest"
    assert t.demonstration(Problem(0, 1, 3), 30, random.Random(0)).endswith("sTwentySeven one \\boxed{1}")
    assert t.demonstration(Problem(0, 1, 2), 30, random.Random(0)) == Problem(0, 1, 2).solution(30)
    assert ModChainTask(ModChainSpec(teacher=t)).records("heldout", limit=1)[0].extra["subset"]


def test_subset_metrics_from_an_evaluation_section(task):
    from sparse_rl_megatron.data.loader import Dataset
    from sparse_rl_megatron.eval.subsets import subset_metrics

    held = task.records("heldout", limit=4)
    ds = Dataset(name="x", path="x", records=held)
    section = {"problems": [{"correct": c, "samples": [{"response_tokens": n}] * 2}
                            for c, n in zip((2, 1, 0, 2), (66, 60, 66, 66))]}
    m = subset_metrics("eval/dense/x", ds, section)
    classes = [r.extra["subset"] for r in held]
    for name in set(classes):
        rows = [i for i, c in enumerate(classes) if c == name]
        assert m[f"eval/dense/x/subset_{name}/accuracy"] == pytest.approx(
            sum(section["problems"][i]["correct"] / 2 for i in rows) / len(rows))
        assert m[f"eval/dense/x/subset_{name}/problems"] == len(rows)
    assert subset_metrics("p", Dataset(name="y", path="y", records=get_task("modchain").records("heldout", limit=4)),
                          section) == {}
    with pytest.raises(ValueError, match="3 evaluated problems for 4 records"):
        subset_metrics("p", ds, {"problems": section["problems"][:3]})
