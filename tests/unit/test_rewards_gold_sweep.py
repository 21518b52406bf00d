"""Every shared data file: the gold solution (or the gold answer as \\boxed{..}) must score correct.

For the sets whose files carry a worked solution (GSM8K, MATH500, Minerva, MATH train), the response is
that solution, so extraction (last \\boxed{} / ``#### N``) and math-verify are both exercised against an
independently stored gold answer (MATH500: the ``answer`` field). For the sets with only an answer field
(or free-form AoPS solutions: AIME24), the response is ``The final answer is \\boxed{gold}``, which checks
that math-verify reads every gold answer and finds it equal to itself. >= 99% must pass; failures are listed.
The benchmarks (what every evaluation scores) are checked whole; the two training sets (~15k rows, the same
GSM8K / MATH answer styles as the benchmarks) every ``TRAIN_STRIDE``-th row: ~7k checks on the 2-worker pool
instead of ~18k.
"""
import time

import pytest

from sparse_rl_megatron.data import load_dataset
from sparse_rl_megatron.rewards import VerifierPool, VerifierPoolConfig, reason_counts

MIN_CORRECT = 0.99
RESPONSE_FROM = {
    "gsm8k": "solution", "math500": "solution", "minerva_math": "solution", "gaokao2023en": "boxed_gold",
    "olympiadbench": "boxed_gold", "aime24": "boxed_gold", "amc23": "boxed_gold",
    "math_train": "solution", "gsm8k_train": "solution",
}
TRAIN_STRIDE = 4
"""Rows 0, 4, 8, ... of the training sets (a fixed sample: the same rows every run)."""


@pytest.fixture(scope="module")
def pool():
    # 10 s per answer: the slowest gold checks take ~1 s alone, more on a shared 2-core machine.
    with VerifierPool(VerifierPoolConfig(num_workers=2, timeout_s=10.0)) as p:
        yield p


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(RESPONSE_FROM))
def test_gold_scores_correct(name, pool, shared_data):
    ds = load_dataset(name, root=shared_data)
    rows = list(ds)[::TRAIN_STRIDE] if name.endswith("_train") else list(ds)
    if RESPONSE_FROM[name] == "solution":
        responses = [r.extra["solution"] for r in rows]
    else:
        responses = [f"The final answer is $\\boxed{{{r.answer}}}$." for r in rows]
    start = time.perf_counter()
    verdicts = pool.check([(resp, r.answer, r.answer_style) for resp, r in zip(responses, rows)])
    seconds = time.perf_counter() - start
    failures = [(r.source_id, r.answer, v.answer, v.reason, v.detail)
                for r, v in zip(rows, verdicts) if not v.correct]
    correct = len(rows) - len(failures)
    print(f"{name}: {correct}/{len(rows)} correct in {seconds:.1f} s; {reason_counts(verdicts)}")
    listing = "\n".join(f"  {sid}: gold={gold!r} answer={ans!r} {reason} {detail}"
                        for sid, gold, ans, reason, detail in failures[:50])
    assert correct >= MIN_CORRECT * len(rows), (
        f"{name}: {len(failures)} of {len(rows)} gold answers fail:\n{listing}")
    # Malformed rows are skipped by the loader, never silently scored: they are few in these files.
    assert len(ds.skipped) <= (1 - MIN_CORRECT) * (len(ds) + len(ds.skipped))


def test_perturbed_gold_scores_zero(pool, shared_data):
    # Known-wrong answers on real problems: the MATH500 numeric golds plus one.
    ds = [r for r in load_dataset("math500", root=shared_data) if r.answer.lstrip("-").isdigit()][:100]
    verdicts = pool.check([(f"\\boxed{{{int(r.answer) + 1}}}", r.answer, "boxed") for r in ds])
    assert len(ds) == 100
    assert [v.reason for v in verdicts] == ["wrong"] * len(ds)
