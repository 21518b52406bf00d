"""The supervised stage (tasks/sft.py) and modchain's warm start built on it."""
import math

import pytest
import torch

from sparse_rl_megatron.tasks.modchain import ModChainModel, ModChainSpec, ModChainTask
from sparse_rl_megatron.tasks.sft import SFTConfig, collate
from sparse_rl_megatron.utils.config_io import ConfigError

TINY = ModChainSpec(steps=6, heldout_size=40, heldout_variants=1, train_variants=2,
                    model=ModChainModel(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64))


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    return ModChainTask(TINY).build_model(tmp_path_factory.mktemp("warm") / "init", seed=0)


def test_lr_schedule_constant_then_cosine_over_the_last_fraction():
    cfg = SFTConfig(steps=10, lr=1.0, min_lr=0.0, decay_fraction=0.4)
    lrs = [cfg.lr_at(s) for s in range(10)]
    assert lrs[:6] == [1.0] * 6
    assert lrs[6] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[9] == pytest.approx(0.0)
    assert SFTConfig(steps=10, lr=0.5, decay_fraction=0.0).lr_at(9) == 0.5


def test_collate_masks_prompts_and_padding():
    ids, labels = collate([([5, 6], [7, 8, 1]), ([5], [9, 1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 1], [5, 9, 1, 0, 0]]
    assert labels.tolist() == [[-100, -100, 7, 8, 1], [-100, 9, 1, -100, -100]]


def test_short_warm_start_lowers_the_loss_deterministically(init_dir, tmp_path):
    task = ModChainTask(TINY)
    opts = dict(steps=30, lr=1e-2, batch_size=8, log_every=0, eval_problems=0)
    m1 = task.warm_start(init_dir, tmp_path / "a", seed=1, **opts)
    assert m1["sft/steps"] == 30 and m1["sft/seconds"] > 0 and m1["sft/cpu_seconds"] > 0
    assert m1["sft/loss_last"] < 0.7 * m1["sft/loss_first"], m1
    task.warm_start(init_dir, tmp_path / "b", seed=1, **opts)
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "tokenizer.json").is_file() and not (tmp_path / "a.partial").exists()
    # continuing from the result (the equal-time supervised control) works from any checkpoint of the task
    m2 = task.warm_start(tmp_path / "a", tmp_path / "c", seed=2, steps=5, lr=1e-3, batch_size=8, log_every=0,
                         eval_problems=4)
    assert m2["sft/loss_first"] < m1["sft/loss_first"] and 0.0 <= m2["sft/heldout_acc"] <= 1.0


def test_bad_options_and_existing_output_are_refused_before_training(init_dir, tmp_path):
    task = ModChainTask(TINY)
    with pytest.raises(ConfigError, match="warm_start: unknown key\\(s\\) stepz; valid keys: .*steps"):
        task.warm_start(init_dir, tmp_path / "x", stepz=3)
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        task.warm_start(init_dir, tmp_path / "x", steps=0)
    (tmp_path / "x").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        task.warm_start(init_dir, tmp_path / "x", steps=1)


def test_key_dropout_mask_keeps_causality_prompt_and_recent_keys():
    from sparse_rl_megatron.tasks.sft import key_dropout_mask

    g = torch.Generator().manual_seed(0)
    length, prompt_lens = 40, torch.tensor([5, 9, 1, 12])
    mask = key_dropout_mask(prompt_lens, length, rate=1.0, prompt_rate=0.0, keep_recent=3, generator=g)
    assert mask.shape == (4, 1, length, length) and mask.dtype == torch.bool
    i, j = torch.arange(length).view(-1, 1), torch.arange(length).view(1, -1)
    causal = j <= i
    for b, p in enumerate(prompt_lens.tolist()):
        m = mask[b, 0]
        assert not (m & ~causal).any()                       # never a future key
        assert m[causal & ((i - j) < 3)].all()               # the recent window (and the query itself)
        assert m[causal & (j < p)].all()                     # prompt keys, with prompt_rate 0
    droppable = causal & ((i - j) >= 3) & (j >= 12)
    assert (~mask[:, 0][:, droppable]).any()                 # some response keys are dropped
    # rate 0 everywhere: plain causal attention
    assert torch.equal(key_dropout_mask(prompt_lens, length, 0.0, 0.0, 1, generator=g)[:, 0], causal.expand(4, -1, -1))
    # prompt keys drop too with prompt_rate > 0; a row's drop rate is u * rate with u ~ U[0, 1]
    many = key_dropout_mask(torch.full((400,), 5), length, 0.0, 1.0, 1, generator=g)[:, 0]
    dropped_prompt = (~many[:, causal & (j < 5) & (i != j)]).float().mean()
    assert 0.4 < float(dropped_prompt) < 0.6


def test_key_dropout_keeps_the_state_the_answer_copies_and_the_offsets_a_step_reads():
    from sparse_rl_megatron.tasks.sft import key_dropout_mask

    length, prompt_lens, answer_from = 30, torch.tensor([4, 4, 4]), torch.tensor([24, 20, 26])
    i, j = torch.arange(length).view(-1, 1), torch.arange(length).view(1, -1)
    causal = j <= i
    plain = key_dropout_mask(prompt_lens, length, 1.0, 0.0, 2, generator=torch.Generator().manual_seed(3))
    mask = key_dropout_mask(prompt_lens, length, 1.0, 0.0, 2, generator=torch.Generator().manual_seed(3),
                            answer_from=answer_from, keep_offsets=(7,))
    dropped = 0
    for b, start in enumerate(answer_from.tolist()):
        m = mask[b, 0]
        assert m[start:, start - 1].all()                    # the answer's queries keep the state it copies
        assert m[causal & (i - j == 7)].all()                # the offset a step reads is never dropped
        assert not (m & ~causal).any()
        # elsewhere the same draws decide as without the options (a run's other masks do not move)
        other = causal & ~((i >= start) & (j == start - 1)) & (i - j != 7)
        assert torch.equal(m[other], plain[b, 0][other])
        dropped += int((~m[other & (i >= start)]).sum())
    assert dropped > 0  # the answer's other keys still drop


def test_the_answer_anchor_is_the_state_each_answer_copies_one_digit_or_two():
    from sparse_rl_megatron.tasks import get_task
    from sparse_rl_megatron.tasks.modchain_problems import digit_word

    task = get_task("modchain31_weak")
    tok = task.tokenizer()
    examples = task.sft_examples(tok)[:400]
    starts = task.answer_starts(tok, examples)
    digits, unanswered = set(), 0
    for (_, response), start in zip(examples, starts):
        if start == len(response):  # the weaker teacher's early stop: no answer to anchor
            unanswered += 1
            continue
        answer = tok.decode(response[start:-1]).strip()
        value = int(answer.removeprefix("\\boxed{").removesuffix("}"))
        assert tok.decode(response[start - 1]).strip() == digit_word(value)  # the state the box copies
        digits.add(len(str(value)))
    assert digits == {1, 2} and 0 < unanswered < len(examples) / 2
    with pytest.raises(ValueError, match="needs answer_starts"):
        from sparse_rl_megatron.tasks.sft import SFTConfig, supervised_finetune

        supervised_finetune("unused", "unused", examples, SFTConfig(key_dropout_answer_anchor=True))


def test_warm_start_with_key_dropout_learns(init_dir, tmp_path):
    task = ModChainTask(TINY)
    m = task.warm_start(init_dir, tmp_path / "kd", seed=0, steps=30, lr=1e-2, batch_size=8, log_every=0,
                        eval_problems=0, key_dropout=0.9, key_dropout_prompt=0.3)
    assert m["sft/loss_last"] < 0.7 * m["sft/loss_first"], m


def test_the_task_sets_its_warm_start_length_and_options_override_it(init_dir, tmp_path):
    from dataclasses import replace

    from sparse_rl_megatron.tasks import get_task

    assert get_task("task:modchain31_wordbox_weak").spec.warm_start_steps == 1000  # the embedded default's task
    assert get_task("task:modchain_weak").spec.warm_start_steps == 300
    task = ModChainTask(replace(TINY, warm_start_steps=3))
    opts = dict(lr=1e-2, batch_size=8, log_every=0, eval_problems=0)
    assert task.warm_start(init_dir, tmp_path / "a", **opts)["sft/steps"] == 3
    assert task.warm_start(init_dir, tmp_path / "b", steps=2, **opts)["sft/steps"] == 2
    with pytest.raises(ValueError, match="warm_start_steps must be >= 1"):
        replace(TINY, warm_start_steps=0)


def test_a_stop_request_ends_the_warm_start_at_the_next_step_and_writes_nothing(init_dir, tmp_path):
    """``should_stop`` is asked before every step (the trainer passes its stop request): the first reason ends the
    warm start with ``StoppedEarly`` (exit status 0 in the CLI), naming the reason and the step, and ``out_dir``
    gets nothing; without a reason it trains to the end."""
    from sparse_rl_megatron.utils.errors import StoppedEarly

    task = ModChainTask(TINY)
    asked = []

    def stop_after_3():
        asked.append(len(asked))
        return "SIGTERM" if len(asked) > 3 else None

    opts = dict(steps=50, lr=1e-2, batch_size=8, log_every=0, eval_problems=0)
    with pytest.raises(StoppedEarly, match=r"^stopped by SIGTERM during the supervised warm start, before step 4 of "
                                           r"50; nothing of it was kept: a re-run builds it again$") as stopped:
        task.warm_start(init_dir, tmp_path / "stopped", should_stop=stop_after_3, **opts)
    assert stopped.value.exit_code == 0 and len(asked) == 4
    assert not (tmp_path / "stopped").exists()
    m = task.warm_start(init_dir, tmp_path / "whole", should_stop=lambda: None, **{**opts, "steps": 3})
    assert m["sft/steps"] == 3 and (tmp_path / "whole" / "config.json").is_file()
