"""``lagchain31_var_weak`` (tasks/lagchain.py with ``lags``): each problem has its own number of registers L, told by
its prompt, so its read lies 2L - 1 positions back; the records, the audit, the warm start's per-example read
offsets (``sft.py``'s ``example_keep_offsets``), and ``lagchain31_weak`` unchanged by the generalisation."""
from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
import torch

from sparse_rl_megatron.tasks import get_task
from sparse_rl_megatron.tasks import lagchain
from sparse_rl_megatron.tasks.lagchain import LagChainSpec, LagChainTask, lag_of, read_offset, states
from sparse_rl_megatron.tasks.modchain_problems import number_word, parse_prompt
from sparse_rl_megatron.tasks.sft import SFTConfig, key_dropout_mask, supervised_finetune

LAGCHAIN31_WEAK_FINGERPRINT = "72c00b63a161c0480105ab21d77c6cd93c9e1f825a8f6445dd064ebf17bb231f"
"""sha256 of lagchain31_weak's held-out records (seeds 0 and 3), its tokenizer's vocabulary and its lengths, as
written before ``lags`` existed (commit 3a364c5)."""


@pytest.fixture(scope="module")
def task():
    return get_task("lagchain31_var_weak")


def test_each_problem_draws_its_registers_and_its_prompt_tells_them(task):
    held = task.records("heldout")
    assert Counter(len(r.extra["initial"]) for r in held).keys() == {2, 3, 4, 5, 6}
    for r in held.records[:100]:
        lag = len(r.extra["initial"])
        words = r.prompt.split()
        assert words[1] == "l" + number_word(lag)  # L's tag, right after Q
        tags = dict(parse_prompt(r.prompt))
        assert [tags[c] for c in "cdefgh" if c in tags] == r.extra["initial"]  # L initial values, no more
        xs = states((tuple(r.extra["initial"]), r.extra["a"], r.extra["b"]), task.spec)
        for k in range(lag, 30):
            assert xs[k] == (xs[k - lag] + (r.extra["a"] if k % 2 else r.extra["b"])) % 31
        solution = r.extra["solution"].split()
        assert [w[0] for w in solution[1:60:2]] == ["vwxyzj"[k % lag] for k in range(30)]  # register letters
        assert solution[-1] == f"\\boxed{{{xs[29]}}}" and r.answer == str(xs[29])
        assert r.extra["shortcut_free"] == all(str(v) != r.answer for _, v in parse_prompt(r.prompt))
    assert len(task.records("train")) == 3600


def test_it_passes_the_shortcut_audit(task):
    from sparse_rl_megatron.tasks.audit import audit_task

    audit = audit_task(task)
    assert audit.passed, "\n".join(audit.lines())


def test_every_word_is_one_token_and_the_read_offset_is_each_examples_own(task):
    tok = task.tokenizer()
    for r in task.records("heldout", limit=20):
        assert len(tok(r.prompt, add_special_tokens=False)["input_ids"]) == len(r.prompt.split()) <= task.prompt_tokens
    assert task.prompt_tokens == 13 and task.response_tokens == 67
    examples, _ = task.sft_examples(tok)
    offsets = task.sft_read_offsets()
    assert len(offsets) == len(examples) and {o for (o,) in offsets} == {3, 5, 7, 9, 11}
    for (prompt, response), (offset,) in list(zip(examples, offsets))[:100]:
        lag = int(next(v for letter, v in parse_prompt(tok.decode(prompt)) if letter == "l"))
        assert offset == read_offset(lag) == 2 * lag - 1
        # the state the first wrapped step writes reads its register's value exactly `offset` positions back
        words = [tok.decode([t]).strip() for t in response]
        query = 2 * lag  # the step word sL, whose next token is the state
        assert words[query - offset][0] == words[query + 1][0] == "v"


def test_per_example_offsets_spare_each_rows_own_distance_and_draw_as_before():
    prompt_lens, length = torch.tensor([3, 3]), 30
    plain = key_dropout_mask(prompt_lens, length, 1.0, 0.0, 1, torch.Generator().manual_seed(5))
    rows = key_dropout_mask(prompt_lens, length, 1.0, 0.0, 1, torch.Generator().manual_seed(5),
                            row_offsets=torch.tensor([[3, 0], [7, 11]]))
    i, j = torch.arange(length).view(-1, 1), torch.arange(length).view(1, -1)
    spared = {0: [3], 1: [7, 11]}
    for b in (0, 1):
        kept = torch.zeros(length, length, dtype=torch.bool)
        for offset in spared[b]:
            kept |= i - j == offset
        assert rows[b, 0][kept].all()  # the row's own distances are always visible
        assert torch.equal(rows[b, 0][~kept], plain[b, 0][~kept])  # every other key as without them
    assert not plain[0, 0][i - j == 7].all() and not plain[1, 0][i - j == 3].all()  # the draws drop at these
    # lagchain31_weak's every example at 11: the same mask as the config's keep_offsets=(11,)
    same = key_dropout_mask(prompt_lens, length, 0.9, 0.0, 3, torch.Generator().manual_seed(7), keep_offsets=(11,))
    per_row = key_dropout_mask(prompt_lens, length, 0.9, 0.0, 3, torch.Generator().manual_seed(7),
                               row_offsets=torch.tensor([[11], [11]]))
    assert torch.equal(same, per_row)
    with pytest.raises(ValueError, match="row_offsets must be"):
        key_dropout_mask(prompt_lens, length, 0.9, row_offsets=torch.tensor([11, 11]))


def test_the_warm_start_spares_each_examples_read(task, tmp_path, monkeypatch):
    task.tokenizer().save_pretrained(tmp_path / "model")
    seen = {}

    def fake(model_dir, out_dir, examples, config, *, seed, answer_starts, example_keep_offsets, should_stop):
        seen.update(examples=examples, config=config, offsets=example_keep_offsets)
        return {}

    monkeypatch.setattr(lagchain, "supervised_finetune", fake)
    task.warm_start(tmp_path / "model", tmp_path / "warm", seed=0)
    assert seen["offsets"] == task.sft_read_offsets(0) and len(seen["offsets"]) == len(seen["examples"])
    assert seen["config"].key_dropout_keep_offsets == () and seen["config"].key_dropout_keep_recent == 3
    with pytest.raises(ValueError, match="example_keep_offsets must give"):
        supervised_finetune(tmp_path / "model", tmp_path / "x", [([1], [2])], SFTConfig(), example_keep_offsets=[])


def test_lagchain31_weak_is_unchanged():
    task = get_task("lagchain31_weak")
    assert not task.spec.told and task.spec.lags == ()
    h = hashlib.sha256()
    for seed in (0, 3):
        for r in task.records("heldout", seed=seed):
            h.update(json.dumps([r.prompt, r.answer, r.source_id, r.extra], sort_keys=True).encode())
    h.update(json.dumps(sorted(task.tokenizer().get_vocab().items())).encode())
    h.update(json.dumps([task.prompt_tokens, task.response_tokens]).encode())
    assert h.hexdigest() == LAGCHAIN31_WEAK_FINGERPRINT
    assert {o for (o,) in task.sft_read_offsets()} == {11}  # as its former keep_offsets=(11,)
    assert all(lag_of((tuple(r.extra["initial"]), 0, 0)) == 6 for r in task.records("heldout", limit=20))


def test_bad_lags_are_refused():
    for lags in ((6,), (2, 2, 6), (4, 3, 6), (1, 6), (2, 5)):
        with pytest.raises(ValueError, match="lags must be empty or"):
            LagChainSpec(lags=lags)
    assert LagChainTask(LagChainSpec(lag=4, lags=(2, 4))).prompt_tokens == 2 + 1 + 4 + 2 + 2
